"""Where does precision fp8 depart from its own rounding? One micro-batch's gradient of every tensor, from the
same init and batch, on up to four engines:

  cuda-fp8   the CUDA engine in fp8 (FP8 products, bf16 elsewhere)
  emu-fp8    the NumPy engine with the same FP8 rounding of the same products (andrea/engines/fp8_emulation.py)
  cuda-fq8   the CUDA engine in bf16 with the operands of those same products rounded to FP8 as the casts round
             them, then bf16 products (fake_quantized below): the FP8 rounding on the GPU without any FP8 kernel
  cuda-bf16  the CUDA engine in bf16
  fp32       the NumPy engine

For each tensor it prints ||a - b|| / ||b|| for cuda-fp8 against emu-fp8 and against cuda-fq8 (the engine
against its own rounding: near bf16's level unless the GPU path is at fault), emu-fp8 against fp32 (what the
FP8 rounding does) and cuda-bf16 against fp32 (for scale), then, with --steps, each engine's losses over that
many steps. Without a CUDA device the CUDA columns are left out. --from-step S takes the gradients at the
parameters after S steps of training in bf16 (fp32 on the NumPy engine without a device), on step S's batch:
activations then have the spread training gives them, which fresh init does not show.

    PYTHONPATH=. python3 dev/cuda/fp8_check.py --shape 120M [--batch 8] [--from-step 80] [--steps 0] [--json out.json]
    PYTHONPATH=. python3 dev/cuda/fp8_check.py --shape tiny --steps 50     # on the CPU too
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from andrea.config import load_experiment  # noqa: E402
from andrea.engines.crosscheck import synthetic_micro_batches, train_run  # noqa: E402
from andrea.engines.fp8_emulation import Fp8EmulationEngine  # noqa: E402
from andrea.engines.numpy_engine import NumpyEngine  # noqa: E402
from andrea.model import Model, init_params  # noqa: E402


def fake_quantized(engine):
    """A bf16 CudaEngine whose attn_qkv, attn_out and mlp products read their operands rounded to FP8 as
    precision fp8 casts them (one power-of-two scale per tensor, E4M3 activations and weights, E5M2
    gradients; the values are exact in bf16), computed with CuPy array operations; recorded graphs off
    (the scale is found on the host)."""
    import dataclasses

    import cupy

    from andrea.ops import fp8

    def fq(x, fmt):  # bf16 in, bf16 out: the FP8 values are exact in bf16
        f = (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
        out = cupy.empty_like(x)
        out.view(cupy.uint16)[...] = (fp8.fake_quantize(cupy, f, fmt).view(cupy.uint32) >> 16).astype(cupy.uint16)
        return out

    lin_f, lin_b, gelu_up, mlp_b = engine._linear_fwd, engine._linear_bwd, engine._gelu_epilogue, engine.mlp_bwd
    qkv_f, qkv_b = engine.attn_qkv_fwd, engine.attn_qkv_bwd
    engine._linear_fwd = lambda out, inp, W, *d: lin_f(out, fq(inp, "e4m3"), fq(W, "e4m3"), *d)
    engine._gelu_epilogue = lambda pre, act, inp, W_1: gelu_up(pre, act, fq(inp, "e4m3"), fq(W_1, "e4m3"))
    engine._linear_bwd = lambda dinp, dW, dout, inp, W, *d: lin_b(dinp, dW, fq(dout, "e5m2"), fq(inp, "e4m3"),
                                                                  fq(W, "e4m3"), *d)
    # the down-projection's products here; the up-projection's go through _linear_bwd with dpre
    engine.mlp_bwd = lambda dinp, dW_1, dW_2, dpre, dout, inp, pre, act, W_1, W_2, *r, **k: mlp_b(
        dinp, dW_1, dW_2, dpre, fq(dout, "e5m2"), inp, pre, fq(act, "e4m3"), W_1, fq(W_2, "e4m3"), *r, **k)
    engine.attn_qkv_fwd = lambda qkv, inp, W: qkv_f(qkv, fq(inp, "e4m3"), fq(W, "e4m3"))
    engine.attn_qkv_bwd = lambda dinp, dW, dqkv, inp, W, *r, **k: qkv_b(dinp, dW, fq(dqkv, "e5m2"), fq(inp, "e4m3"),
                                                                        fq(W, "e4m3"), *r, **k)
    engine.traits = dataclasses.replace(engine.traits, graphs=False)
    return engine


def engines() -> dict:
    found = {"emu-fp8": Fp8EmulationEngine, "fp32": NumpyEngine}
    from andrea.engines import cuda_available

    if cuda_available():
        from andrea.engines.cuda_engine import CudaEngine

        found = {"cuda-fp8": lambda: CudaEngine(precision="fp8"), **found,
                 "cuda-fq8": lambda: fake_quantized(CudaEngine(precision="bf16")),
                 "cuda-bf16": lambda: CudaEngine(precision="bf16")}
    return found


def gradients(make, exp, B: int, seed: int, params: np.ndarray | None = None, step: int = 0) -> tuple[dict, float]:
    """Per-tensor gradients (float64, on the host) of step `step`'s micro-batch of the synthetic stream at
    `params` (default: init), and its loss."""
    engine = make()
    options = {"recompute": tuple(exp.recompute), "loss_chunks": exp.loss_chunks}
    model = Model(engine, exp.model, B, **options)
    model.load_state(init_params(model.layout, seed) if params is None else params)
    (tokens, targets), = synthetic_micro_batches(exp.model, B, 1, step, seed)
    loss = model.forward_backward(tokens, targets)
    flat = engine.to_host(model.buf["grads"]).astype(np.float64)
    return {t.name: flat[t.offset:t.end] for t in model.layout.tensors}, loss


def rel(a: np.ndarray, b: np.ndarray) -> float:
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / d) if d else float(np.linalg.norm(a))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", choices=("tiny", "12M", "120M"))
    parser.add_argument("--batch", type=int, help="micro-batch (default: the experiment's)")
    parser.add_argument("--steps", type=int, default=0, help="also train this many steps on each engine")
    parser.add_argument("--from-step", type=int, default=0,
                        help="gradients at the parameters after this many steps of training (default: init)")
    parser.add_argument("--warm-batch", type=int, help="the micro-batch of those steps (default: --batch)")
    parser.add_argument("--train-on", nargs="+", help="the engines --steps trains (default: all)")
    parser.add_argument("--skip", nargs="+", default=(), help="engines left out of the gradient comparison")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    exp = load_experiment(REPO / "config" / "experiments" / f"ANDREA-{args.shape}-TRAIN.json")
    B = args.batch or exp.micro_batch_size
    found = engines()
    params = None
    if args.from_step:
        warm = "cuda-bf16" if "cuda-bf16" in found else "fp32"
        params = train_run(found[warm](), exp.model, args.warm_batch or B, 1, args.from_step, args.seed, recompute=tuple(exp.recompute),
                           loss_chunks=exp.loss_chunks).params
        print(f"parameters after {args.from_step} steps on {warm}")
    runs = {name: gradients(make, exp, B, args.seed, params, args.from_step) for name, make in found.items()
            if name not in args.skip}
    pairs = [(a, b) for a, b in (("cuda-fp8", "emu-fp8"), ("cuda-fp8", "cuda-fq8"), ("emu-fp8", "fp32"),
                                             ("cuda-bf16", "fp32"))
             if a in runs and b in runs]
    report = {"shape": args.shape, "micro_batch": B, "from_step": args.from_step, "loss": {k: v[1] for k, v in runs.items()}, "grad_rel": {}}
    print(f"{args.shape} B={B}: first-batch loss " + ", ".join(f"{k} {v[1]:.5f}" for k, v in runs.items()))
    print(f"{'tensor':22}" + "".join(f"{a + ' vs ' + b:>24}" for a, b in pairs))
    for name in next(iter(runs.values()))[0]:
        row = {f"{a}/{b}": rel(runs[a][0][name], runs[b][0][name]) for a, b in pairs}
        report["grad_rel"][name] = row
        print(f"{name:22}" + "".join(f"{v:>24.3e}" for v in row.values()))
    if args.steps:
        report["losses"] = {name: train_run(make(), exp.model, B, 1, args.steps, args.seed, recompute=tuple(exp.recompute),
                                            loss_chunks=exp.loss_chunks).losses
                             for name, make in found.items() if not args.train_on or name in args.train_on}
        for name, ls in report["losses"].items():
            print(f"{name:10} " + " ".join(f"{x:.3f}" for x in ls[::max(1, args.steps // 10)]) + f" last {ls[-1]:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
