"""How much the backward's weight-gradient products gain on a second stream: an upper bound, before any design.

    PYTHONPATH=. python3 dev/cuda/aside_ab.py [--shapes 120M,12M] [--rounds 2] [--precision bf16]

Each variant is a fresh CudaEngine whose cuBLAS weight-gradient products (trans_a, beta 1) run on a side stream
with a cuBLAS handle and workspace of their own, each after the main stream's work so far; the main stream waits
for them ("join") after each backward op that launched one ("op": no hazard), after each layer's attn_qkv_bwd
("layer": LN2's backward may overwrite d_branch under dW_2), or at the backward's end ("end": hazards ignored).
"-prio" variants also record the step on a higher-priority stream. It prints ms a step and the final weights'
bits against the plain engine's, and exits 1 if an "op" or "layer" variant's differ (those have no hazard).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench import BENCH, EXPERIMENTS, options, per_step_ms  # noqa: E402

JOIN_AFTER = {"op": ("mlp_bwd", "attn_out_bwd", "attn_qkv_bwd"), "layer": ("attn_qkv_bwd",), "end": ()}


def aside(engine, model, join: str, prio: bool) -> None:
    import cupy

    from andrea.engines.cublas import Cublas
    from andrea.engines.cuda_engine import CUBLAS_WORKSPACE_BYTES

    side = cupy.cuda.Stream(non_blocking=True)
    blas_side = Cublas(False, cupy.zeros(CUBLAS_WORKSPACE_BYTES, dtype=cupy.uint8))
    plain = engine.blas.gemm
    pending = []

    def gemm(c, a, b, m, n, k, *, trans_a=False, beta=0.0, **kw):
        if not (trans_a and beta == 1.0):
            return plain(c, a, b, m, n, k, trans_a=trans_a, beta=beta, **kw)
        cur = cupy.cuda.get_current_stream()
        ev = cupy.cuda.Event(block=False, disable_timing=True)
        ev.record(cur)
        side.wait_event(ev)
        with side:
            blas_side.gemm(c, a, b, m, n, k, trans_a=trans_a, beta=beta, **kw)
        done = cupy.cuda.Event(block=False, disable_timing=True)
        done.record(side)
        pending.append((ev, done))

    def joined():
        if pending:
            cupy.cuda.get_current_stream().wait_event(pending[-1][1])
            keep.extend(pending)
            pending.clear()

    keep: list = []
    engine.blas.gemm = gemm
    for name in JOIN_AFTER[join]:
        method = getattr(engine, name)

        def call(*a, _m=method, **k):
            r = _m(*a, **k)
            joined()
            return r
        setattr(engine, name, call)
    backward = model._backward

    def whole(*a, **k):
        backward(*a, **k)
        joined()
    model._backward = whole
    if prio:  # -5: CUDA clamps it to the device's greatest priority
        engine.capture = lambda fn: type(engine).capture(engine, fn, priority=-5)


def run(name: str, precision: str, variant: str | None, steps: int) -> tuple[float, str]:
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.model import Model, init_params

    shape, micro = EXPERIMENTS[name].model, BENCH[name]
    engine = CudaEngine(precision=precision)
    model = Model(engine, shape, micro, graphs=True, **options(name))
    model.load_state(init_params(model.layout, 0))
    if variant:
        join, _, prio = variant.partition("-")
        aside(engine, model, join, prio == "prio")
    ms = per_step_ms(model, steps=steps, warm=3)
    bits = hashlib.sha256(model.host_state()[0].tobytes()).hexdigest()[:12]
    return ms, bits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="120M,12M")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=23)
    ap.add_argument("--variants", default="op,layer,end,end-prio")
    args = ap.parse_args()
    unequal = []
    for name in args.shapes.split(","):
        for r in range(args.rounds):
            plain_bits = None
            for variant in [None, *args.variants.split(",")]:
                ms, bits = run(name, args.precision, variant, args.steps)
                plain_bits = plain_bits or bits
                print(f"{name} {args.precision} round {r} {variant or 'plain':10} {ms:.3f} ms  weights {bits}",
                      flush=True)
                if variant and not variant.startswith("end") and bits != plain_bits:
                    unequal.append(f"{name} round {r} {variant}")
    # the joined variants have no hazard: weights other than the plain engine's mean the side stream raced
    for what in unequal:
        print(f"FAIL {what}: weights differ from the plain engine's", file=sys.stderr)
    return 1 if unequal else 0


if __name__ == "__main__":
    sys.exit(main())
