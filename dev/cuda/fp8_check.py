"""Where does precision fp8 depart from its own rounding, and what does the rounding do to training? One
micro-batch's gradient of every tensor, from the same init and batch, on these engines (default: those this
machine runs):

  cuda-fp8   the CUDA engine in fp8 (FP8 products, bf16 elsewhere)
  emu-fp8    the NumPy engine with the same FP8 rounding of the same products (andrea/engines/fp8_emulation.py)
  cuda-fq8   the CUDA engine in bf16 with the operands of those same products rounded to FP8 as the casts round
             them (fp8.fake_quantize), then bf16 products: the FP8 rounding on the GPU without any FP8 kernel
  cuda-bf16  the CUDA engine in bf16 (--engines takes any cuda-<precision>)
  fp32       the NumPy engine

For each tensor it prints ||a - b|| / ||b|| for cuda-fp8 against emu-fp8 and against cuda-fq8 (the engine
against its own rounding: a wrong layout, scale or operand shows as 100% or more), emu-fp8 against fp32
(what the FP8 rounding does) and cuda-bf16 against fp32 (for scale); then, with --steps, each engine's losses
over that many steps from the same init. --from-step S takes the gradients at the parameters after S steps
of training in bf16 (fp32 without a device), where activations have the spread training gives them. --text
trains on a tokens folder's windows instead of the synthetic stream (the windows of
tests/test_gpu_scale.py's text parity test) and adds the held-out loss on its validation shard.

    PYTHONPATH=. python3 dev/cuda/fp8_check.py --shape 120M --batch 4 --warm-batch 8 --from-step 80
    PYTHONPATH=. python3 dev/cuda/fp8_check.py --shape 120M --batch 8 --engines cuda-fp8 cuda-fq8 cuda-bf16 --steps 200
    PYTHONPATH=. python3 dev/cuda/fp8_check.py --shape 120M --batch 8 --text results/data/tokens-V4096 --steps 200 \
        --engines cuda-fp32 cuda-bf16 cuda-fp16 cuda-fp8 cuda-fq8
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
from andrea.engines.crosscheck import (held_out_micro_batches, synthetic_micro_batches,  # noqa: E402
                                       text_micro_batches, train_run)
from andrea.engines.fp8_emulation import Fp8EmulationEngine  # noqa: E402
from andrea.engines.numpy_engine import NumpyEngine  # noqa: E402
from andrea.model import Model, init_params  # noqa: E402
from andrea.shards import read_shard  # noqa: E402


def fake_quantized(engine):
    """A bf16 CudaEngine whose attn_qkv and mlp products read their operands rounded to FP8 as
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
    def linear_fwd(out, inp, W, *d, fp8=True):  # fp8=False (attn_out): the plain product, as precision fp8 runs it
        return lin_f(out, fq(inp, "e4m3") if fp8 else inp, fq(W, "e4m3") if fp8 else W, *d, fp8=fp8)

    def linear_bwd(dinp, dW, dout, inp, W, *d, fp8=True, **kw):  # dpre at its own scale (fp8 takes a bound's)
        if fp8:
            dout, inp, W = fq(dout, "e5m2"), fq(inp, "e4m3"), fq(W, "e4m3")
        return lin_b(dinp, dW, dout, inp, W, *d, fp8=fp8, **kw)

    engine._linear_fwd, engine._linear_bwd = linear_fwd, linear_bwd
    engine._gelu_epilogue = lambda pre, act, inp, W_1: gelu_up(pre, act, fq(inp, "e4m3"), fq(W_1, "e4m3"))
    # the down-projection's products here; the up-projection's go through _linear_bwd with dpre
    engine.mlp_bwd = lambda dinp, dW_1, dW_2, dpre, dout, inp, pre, act, W_1, W_2, *r, **k: mlp_b(
        dinp, dW_1, dW_2, dpre, fq(dout, "e5m2"), inp, pre, fq(act, "e4m3"), W_1, fq(W_2, "e4m3"), *r, **k)
    engine.attn_qkv_fwd = lambda qkv, inp, W: qkv_f(qkv, fq(inp, "e4m3"), fq(W, "e4m3"))
    engine.attn_qkv_bwd = lambda dinp, dW, dqkv, inp, W, *r, **k: qkv_b(dinp, dW, fq(dqkv, "e5m2"), fq(inp, "e4m3"),
                                                                        fq(W, "e4m3"), *r, **k)
    engine.traits = dataclasses.replace(engine.traits, graphs=False)
    return engine


DEFAULT_ENGINES = ("cuda-fp8", "emu-fp8", "cuda-fq8", "cuda-bf16", "fp32")


def engines() -> dict:
    """name -> engine factory: the NumPy ones anywhere, the CUDA ones (any precision as cuda-<precision>) with
    a device."""
    found = {"emu-fp8": Fp8EmulationEngine, "fp32": NumpyEngine}
    from andrea.engines import cuda_available

    if cuda_available():
        from andrea.engines.cuda_engine import CudaEngine
        from andrea.precision import PRECISIONS

        found.update({f"cuda-{p}": (lambda p=p: CudaEngine(precision=p)) for p in PRECISIONS})
        found["cuda-fq8"] = lambda: fake_quantized(CudaEngine(precision="bf16"))
    return found


def gradients(make, exp, B: int, seed: int, batch, params: np.ndarray | None = None) -> tuple[dict, float]:
    """Per-tensor gradients (float64, on the host) of one micro-batch (tokens, targets) at `params` (default:
    init), and its loss."""
    engine = make()
    options = {"recompute": tuple(exp.recompute), "loss_chunks": exp.loss_chunks}
    model = Model(engine, exp.model, B, **options)
    model.load_state(init_params(model.layout, seed) if params is None else params)
    loss = model.forward_backward(*batch)
    flat = engine.to_host(model.buf["grads"]).astype(np.float64)
    return {t.name: flat[t.offset:t.end] for t in model.layout.tensors}, loss


def rel(a: np.ndarray, b: np.ndarray) -> float:
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / d) if d else float(np.linalg.norm(a))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", choices=("tiny", "12M", "120M"))
    parser.add_argument("--batch", type=int, help="micro-batch (default: the experiment's)")
    parser.add_argument("--engines", nargs="+", help=f"the engines compared (default: {' '.join(DEFAULT_ENGINES)}, "
                        "those this machine runs; any cuda-<precision> too)")
    parser.add_argument("--steps", type=int, default=0, help="also train this many steps on each engine")
    parser.add_argument("--train-on", nargs="+", help="the engines --steps trains (default: --engines)")
    parser.add_argument("--text", type=Path, help="a tokens folder (train.bin, val.bin: `andrea tokenize`'s) to use instead "
                        "of the synthetic stream; --steps then also reports the held-out loss (the validation shard)")
    parser.add_argument("--from-step", type=int, default=0,
                        help="gradients at the parameters after this many steps of training (default: init)")
    parser.add_argument("--warm-batch", type=int, help="the micro-batch of those steps (default: --batch)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    exp = load_experiment(REPO / "config" / "experiments" / f"ANDREA-{args.shape}-TRAIN.json")
    B, T = args.batch or exp.micro_batch_size, exp.model.seq_len
    found = engines()
    names = args.engines or [n for n in DEFAULT_ENGINES if n in found]
    unknown = [n for n in names + (args.train_on or []) if n not in found]
    if unknown:
        parser.error(f"no engine {', '.join(unknown)} here (this machine has: {', '.join(found)})")
    options = {"recompute": tuple(exp.recompute), "loss_chunks": exp.loss_chunks}
    held_out = ()
    if args.text:
        train, val = read_shard(args.text / "train.bin"), read_shard(args.text / "val.bin")
        held_out = held_out_micro_batches(val, T, B)

        def stream(step, micro=B):
            return text_micro_batches(train, T, micro, 1, step)
    else:
        def stream(step, micro=B):
            return synthetic_micro_batches(exp.model, micro, 1, step, args.seed)
    params = None
    if args.from_step:
        warm = "cuda-bf16" if "cuda-bf16" in found else "fp32"
        micro = args.warm_batch or B
        params = train_run(found[warm](), exp.model, micro, 1, args.from_step, args.seed, **options,
                           stream=lambda step: stream(step, micro)).params
        print(f"parameters after {args.from_step} steps on {warm}")
    (batch,) = stream(args.from_step)
    runs = {name: gradients(found[name], exp, B, args.seed, batch, params) for name in names}
    pairs = [(a, b) for a, b in (("cuda-fp8", "emu-fp8"), ("cuda-fp8", "cuda-fq8"), ("emu-fp8", "fp32"),
                                 ("cuda-bf16", "fp32")) if a in runs and b in runs]
    report = {"shape": args.shape, "micro_batch": B, "from_step": args.from_step, "text": str(args.text or ""),
              "loss": {k: v[1] for k, v in runs.items()}, "grad_rel": {}}
    print(f"{args.shape} B={B}: the batch's loss " + ", ".join(f"{k} {v[1]:.5f}" for k, v in runs.items()))
    print(f"{'tensor':22}" + "".join(f"{a + ' vs ' + b:>24}" for a, b in pairs))
    for name in next(iter(runs.values()))[0]:
        row = {f"{a}/{b}": rel(runs[a][0][name], runs[b][0][name]) for a, b in pairs}
        report["grad_rel"][name] = row
        print(f"{name:22}" + "".join(f"{v:>24.3e}" for v in row.values()))
    if args.steps:
        report["losses"], report["held_out"] = {}, {}
        for name in args.train_on or names:
            run = train_run(found[name](), exp.model, B, 1, args.steps, args.seed, **options, stream=stream,
                            held_out=held_out)
            report["losses"][name], report["held_out"][name] = run.losses, run.held_out
            ls = run.losses
            print(f"{name:10} " + " ".join(f"{x:.3f}" for x in ls[::max(1, args.steps // 10)]) + f" last {ls[-1]:.4f}"
                  + (f" held-out {run.held_out:.4f}" if held_out else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
