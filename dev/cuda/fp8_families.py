"""Where precision fp8 pays, op family by op family: the fp8 step with some of its FP8 products moved back to bf16.

    PYTHONPATH=. python3 dev/cuda/fp8_families.py [--shapes 120M,12M] [--rounds 2] [--steps 23]

Each variant is a fresh fp8 CudaEngine whose chosen methods run with FP8 off (engine.fp8 False for the call, so
`_fp8_ok` says no and the op takes its bf16 products; the MLP's down-projection backward, which the op routes to
`_linear_bwd_fp8` itself, reports "not run" instead), a model at the benchmark's micro-batch and options, and
scripts/bench.py's per_step_ms over --steps steps as CUDA graphs, the variants alternating for --rounds rounds;
then the bf16 step in the same process. A bf16 down product reads act in bf16, so its variants turn the act
history's path off too (`_act_delayed`: act written in bf16 by the up product's GELU epilogue, then its amax and
cast for dW_2's FP8 operand where that stays on FP8). It prints each variant's ms a step and its ratio to bf16, or
"not run" and why where the mix fails. It measures and does not judge: the variants' bits differ from precision
fp8's (that is the point). Run on a CUDA machine with FP8.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench import BENCH, EXPERIMENTS, options, per_step_ms  # noqa: E402


def _down_fwd(out, inp, W, N, K, M, **kw) -> bool:  # _linear_fwd of the MLP's W_2: K = 4 M
    return K == 4 * M


def _down_bwd(dinp, dW, dout, inp, W, N, K, M, *_, **__) -> bool:  # _linear_bwd_fp8 of W_2
    return K == 4 * M


# variant: the engine methods that run in bf16 (a method alone, or with a test of its arguments)
VARIANTS = {
    "fp8 as it ships": [],
    "the MLP's down product in bf16": [("_act_delayed", None), ("_linear_fwd", _down_fwd),
                                       ("_linear_bwd_fp8", _down_bwd)],
    "the MLP's backward and down product in bf16": [("_act_delayed", None), ("_linear_fwd", _down_fwd),
                                                    ("mlp_bwd", None)],
    "the whole MLP in bf16": [("mlp_fwd", None), ("mlp_bwd", None)],
    "attention's and qkv's backward in bf16": [("attn_bwd", None), ("attn_qkv_bwd", None)],
}


def bf16_calls(engine, name: str, when=None) -> None:
    """engine.<name> runs with FP8 off (where `when` says so of its arguments, or always)."""
    method = getattr(engine, name)
    if name == "_linear_bwd_fp8":  # runs on FP8 whatever engine.fp8 says: it reports "not run" instead
        setattr(engine, name, lambda *a, **k: (False, False, None, None) if when(*a, **k) else method(*a, **k))
        return

    def call(*a, **k):
        if when is not None and not when(*a, **k):
            return method(*a, **k)
        engine.fp8 = False
        try:
            return method(*a, **k)
        finally:
            engine.fp8 = True
    setattr(engine, name, call)


def step_ms(name: str, precision: str, patches, steps: int) -> float:
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.model import Model, init_params

    shape, micro = EXPERIMENTS[name].model, BENCH[name]
    engine = CudaEngine(precision=precision)
    for method, when in patches:
        bf16_calls(engine, method, when)
    model = Model(engine, shape, micro, graphs=True, **options(name))
    model.load_state(init_params(model.layout, 0))
    return per_step_ms(model, steps=steps, warm=3)


def main() -> int:
    from andrea.model import NonFiniteStep

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="120M,12M", help="comma-separated: 12M, 120M")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the variants, alternating (default 2)")
    ap.add_argument("--steps", type=int, default=23, help="steps of each timing, 3 of them warm-up (default 23)")
    args = ap.parse_args()
    for name in args.shapes.split(","):
        times = {label: [] for label in VARIANTS}
        failed: dict[str, str] = {}
        for _ in range(args.rounds):
            for label, patches in VARIANTS.items():
                if label in failed:
                    continue
                try:
                    times[label].append(step_ms(name, "fp8", patches, args.steps))
                except (RuntimeError, NonFiniteStep) as e:  # a mix that fails (the module docstring says how)
                    failed[label] = f"{type(e).__name__}: {e}"
        bf16 = step_ms(name, "bf16", [], args.steps)
        print(f"{name}: bf16 {bf16:.2f} ms", flush=True)
        for label, t in times.items():
            if label in failed:
                print(f"  {label:44} not run: {failed[label]}", flush=True)
                continue
            print(f"  {label:44} {' / '.join(f'{x:.2f}' for x in t)} ms  ({bf16 / statistics.mean(t):.3f}x bf16)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
