"""The LayerNorm forward writing E4M3 itself (kernels/layernorm.cu's k_layernorm_fwd_e4m3) against what precision fp8
ran before it for each of a layer's two LayerNorm outputs: k_layernorm_fwd (the residual add fused, the output in
bf16 with its amax), then k_fp8_cast (both E4M3 layouts at that amax's scale).

    PYTHONPATH=. python3 dev/cuda/ln_e4m3.py [--shapes 120M,12M]
    ANDREA_KERNELS=other/kernels PYTHONPATH=. python3 dev/cuda/ln_e4m3.py    # a variant's kernels

The kernel scales by a bound of the output known before the pass (andrea/ops/layernorm.py's e4m3_bound; its rounding
on the CPU: dev/cuda/fp8_ln_bound.py), so it writes X and X^T as it normalises, with no amax and no cast pass. First, on fresh random inputs at the
benchmark's shapes and a ragged one, its bytes are checked against the engine's own kernels with the cast at the same
bound (k_fp8_cast reads the bound where it reads the amax): the residual sum, mean, rstd, X and X^T must be the same
bits, the descale the bound's, and X the reference `quantize` of the engine's bf16 output at the bound. Then both
paths are timed in CUDA graphs on the step's shapes. Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import cupy as cp  # noqa: E402

from andrea.engines.cuda_engine import CudaEngine  # noqa: E402
from andrea.ops import fp8  # noqa: E402
from andrea.ops.layernorm import e4m3_bound  # noqa: E402
from andrea.ops.base import blocks, kernel_defines  # noqa: E402
from andrea.timing import graph_ms  # noqa: E402

SHAPES = {"120M": (8 * 1024, 768), "12M": (32 * 512, 384)}  # the benchmark's tokens a step, d_model
RAGGED = (1000, 136)  # rows not a whole number of blocks nor of 16 (X^T written byte by byte at the edge)


def host_f32(a) -> np.ndarray:
    """A device array's values as host float32."""
    return cp.asnumpy(a).astype(np.float32)


class Paths:
    """Both paths over one set of device buffers of N rows of C."""

    def __init__(self, engine: CudaEngine, N: int, C: int, rng: np.random.Generator):
        self.engine, self.N, self.C = engine, N, C
        bf16 = engine.traits.act_dtype
        self.a, self.b = cp.zeros((N, C), dtype=bf16), cp.zeros((N, C), dtype=bf16)
        engine.upload(self.a, (rng.standard_normal((N, C)) * 2 + 0.5).astype(np.float32))
        engine.upload(self.b, rng.standard_normal((N, C)).astype(np.float32))
        self.gamma_h = (1 + 0.3 * rng.standard_normal(C)).astype(np.float32)
        self.beta_h = (0.2 * rng.standard_normal(C)).astype(np.float32)
        self.gamma, self.beta = cp.asarray(self.gamma_h), cp.asarray(self.beta_h)
        self.bound = e4m3_bound(self.gamma_h, self.beta_h)
        self.bound_word = cp.asarray(np.array([self.bound], dtype=np.float32).view(np.uint32))
        self.amax = cp.zeros(1, dtype=np.uint32)
        self.out = {}
        for name in ("engine", "kernel"):
            self.out[name] = dict(x=cp.zeros((N, C), dtype=bf16), y=cp.zeros((N, C), dtype=bf16),
                                  mean=cp.zeros(N, dtype=np.float32), rstd=cp.zeros(N, dtype=np.float32),
                                  q=cp.zeros(N * C, dtype=np.uint8), qt=cp.zeros(N * C, dtype=np.uint8),
                                  descale=cp.zeros(4, dtype=np.float32))

    def engine_path(self, own_amax: bool = False) -> None:
        """k_layernorm_fwd (fused; with `own_amax` its output's amax too), then k_fp8_cast at the scale of that amax
        (the step's order), or else of the bound."""
        o, e, N, C = self.out["engine"], self.engine, self.N, self.C
        threads = kernel_defines("layernorm")["LN_THREADS"]
        word = self.amax if own_amax else np.uint64(0)
        e._launch("k_layernorm_fwd", blocks(N, threads // 32), threads, o["y"], o["mean"], o["rstd"], o["x"],
                  self.gamma, self.beta, np.int64(N), np.int32(C), self.a, self.b, np.int32(1), word)
        d = kernel_defines("fp8")
        grid = (-(-C // d["FP8_TILE"]), -(-N // d["FP8_TILE"]), 1)
        e.k["k_fp8_cast"](grid, (d["FP8_THREADS"],), (
            o["q"], np.int64(C), np.int64(0), o["qt"], np.int64(N), np.int64(0), o["descale"],
            self.amax if own_amax else self.bound_word, o["y"], np.int32(N), np.int32(C), np.int32(0)))

    def kernel_path(self) -> None:
        o, N, C, d = self.out["kernel"], self.N, self.C, kernel_defines("layernorm")
        self.engine._launch("k_layernorm_fwd_e4m3", blocks(N, d["LN_E4M3_ROWS"]), 32 * d["LN_E4M3_WARPS"], o["q"],
                            o["qt"], o["descale"], o["mean"], o["rstd"], o["x"], self.gamma, self.beta, np.int64(N),
                            np.int32(C), self.a, self.b, np.int32(1))


def check(paths: Paths) -> list[str]:
    """What differs between the two paths' bytes (empty: nothing), and against the reference quantize."""
    paths.engine_path()
    paths.kernel_path()
    cp.cuda.get_current_stream().synchronize()
    e, k, bad = paths.out["engine"], paths.out["kernel"], []
    for name in ("x", "mean", "rstd", "q", "qt"):
        same = bool(cp.all(e[name].view(np.uint8) == k[name].view(np.uint8)))
        if not same:
            differ = int(cp.count_nonzero(e[name].view(np.uint8) != k[name].view(np.uint8)))
            bad.append(f"{name}: {differ} bytes differ")
    if float(k["descale"][0]) != 2.0 ** -fp8.scale_exponent(paths.bound, "e4m3"):
        bad.append(f"descale {float(k['descale'][0])} against the bound's")
    y = host_f32(e["y"])
    q_ref, _ = fp8.quantize(y, "e4m3", amax=paths.bound)
    if not np.array_equal(q_ref.reshape(-1), cp.asnumpy(k["q"])):
        bad.append("X is not quantize(the engine's bf16 output, the bound)")
    if not np.array_equal(q_ref.T.reshape(-1), cp.asnumpy(k["qt"])):
        bad.append("X^T is not X transposed")
    if float(np.abs(y).max()) > paths.bound * (1 + 2.0**-7):
        bad.append(f"an output {float(np.abs(y).max())} over the bound {paths.bound}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="120M,12M", help=f"of {tuple(SHAPES)} (default 120M,12M)")
    args = ap.parse_args(argv)
    engine = CudaEngine(precision="fp8")
    k = engine.k["k_layernorm_fwd_e4m3"]
    print(f"k_layernorm_fwd_e4m3: {k.num_regs} registers, {k.local_size_bytes} bytes of local memory", flush=True)
    rng = np.random.default_rng(20261205)
    failed = False
    shapes = [(name, SHAPES[name]) for name in args.shapes.split(",")] + [("ragged", RAGGED)]
    for name, (N, C) in shapes:
        paths = Paths(engine, N, C, rng)
        bad = check(paths)
        failed |= bool(bad)
        slack = np.log2(paths.bound / float(np.abs(host_f32(paths.out["engine"]["y"])).max()))
        verdict = "same bytes" if not bad else "FAILED: " + "; ".join(bad)
        print(f"{name} N {N} C {C}: {verdict} (the bound 2^{slack:.2f} over the output's amax)", flush=True)
        if name == "ragged":
            continue
        now = graph_ms(engine, lambda: paths.engine_path(own_amax=True), reps=7)
        new = graph_ms(engine, paths.kernel_path, reps=7)
        moved = 2 * N * C * 2 + 2 * N * C  # a, b read, x written (bf16), X and X^T written (E4M3)
        print(f"  LayerNorm + cast {now * 1e3:.2f} us; the LayerNorm writing E4M3 {new * 1e3:.2f} us "
              f"({moved / new / 1e9:.2f} TB/s); a step's {24 if name == '120M' else 12} LayerNorms "
              f"{(new - now) * (24 if name == '120M' else 12):+.3f} ms", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
