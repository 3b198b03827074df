"""The MLP's six products in two orientations: pre, act and dpre stored [N, F] (the engine's) or [F, N].

    PYTHONPATH=. python3 dev/cuda/mlp_orient.py [--shapes 120M,12M]

cuBLASLt's GELU epilogues write and read aux in D's layout, so which kernel family runs the GELU_AUX and
DGELU products depends on which of pre and pre^T the MLP keeps; the other four products then read act and
dpre with the other transposition. Each product is timed alone in a CUDA graph (timing.graph_ms) on fresh
random operands, on every algorithm the heuristic offers (and cublasGemmEx for the plain ones); the fastest
counts. Prints each product's best and each orientation's sum for a layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from andrea.timing import graph_ms  # noqa: E402

SHAPES = {"120M": (8 * 1024, 768), "12M": (32 * 512, 384)}  # (N tokens of the benchmark's micro-batch, C)


def products(N: int, C: int, transposed: bool) -> dict:
    """name -> (out, a, b, m, n, k, trans_a, trans_b, epilogue, aux) of a layer's MLP products."""
    F = 4 * C
    rng = np.random.default_rng(1)

    def t(*shape, scale=0.5):
        return cupy.asarray((rng.standard_normal(shape, dtype=np.float32) * scale).astype(ml_dtypes.bfloat16))

    inp, dout, W_1, W_2 = t(N, C), t(N, C), t(C, F, scale=0.03), t(F, C, scale=0.03)
    out, dinp = t(N, C), t(N, C)
    dW_1, dW_2 = cupy.zeros((C, F), cupy.float32), cupy.zeros((F, C), cupy.float32)
    if not transposed:
        pre, act, dpre = t(N, F), t(N, F), t(N, F)
        return {
            "up gelu_aux": (act, inp, W_1, N, F, C, False, False, "gelu_aux", pre),
            "down": (out, act, W_2, N, C, F, False, False, "none", None),
            "dW_2": (dW_2, act, dout, F, C, N, True, False, "none", None),
            "dgelu": (dpre, dout, W_2, N, F, C, False, True, "dgelu", pre),
            "dW_1": (dW_1, inp, dpre, C, F, N, True, False, "none", None),
            "dinp": (dinp, dpre, W_1, N, C, F, False, True, "none", None),
        }
    preT, actT, dpreT = t(F, N), t(F, N), t(F, N)
    return {
        "up gelu_aux": (actT, W_1, inp, F, N, C, True, True, "gelu_aux", preT),
        "down": (out, actT, W_2, N, C, F, True, False, "none", None),
        "dW_2": (dW_2, actT, dout, F, C, N, False, False, "none", None),
        "dgelu": (dpreT, W_2, dout, F, N, C, False, True, "dgelu", preT),
        "dW_1": (dW_1, inp, dpreT, C, F, N, True, True, "none", None),
        "dinp": (dinp, dpreT, W_1, N, C, F, True, True, "none", None),
    }


def best(engine, spec) -> tuple[float, str]:
    out, a, b, m, n, k, ta, tb, epi, aux = spec
    lt = engine.blas_lt
    kw = dict(trans_a=ta, trans_b=tb, epilogue=epi, aux=aux)
    times = {}
    if epi == "none":
        times["gemmex"] = graph_ms(engine, lambda: engine.blas.gemm_ex(out, a, b, m, n, k, trans_a=ta, trans_b=tb))
    for i in range(lt.algorithms(out, a, b, m, n, k, **kw)):
        times[f"lt{i}"] = graph_ms(engine, lambda: lt.gemm(out, a, b, m, n, k, **kw, algo=i))
    if not times:
        return float("nan"), "none"
    name = min(times, key=times.get)
    return times[name], name + " (" + " ".join(f"{v:.4f}" for v in times.values()) + ")"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="120M,12M")
    args = ap.parse_args()
    from andrea.engines.cuda_engine import CudaEngine

    engine = CudaEngine(precision="bf16")
    failed = False
    for shape in args.shapes.split(","):
        N, C = SHAPES[shape]
        sums = {}
        for transposed in (False, True):
            label = "[F, N]" if transposed else "[N, F]"
            total = 0.0
            for pname, spec in products(N, C, transposed).items():
                ms, how = best(engine, spec)
                failed |= ms != ms
                total += ms
                print(f"{shape} {label} {pname:12s} {ms:.4f} ms  {how}", flush=True)
            sums[label] = total
            print(f"{shape} {label} sum {total:.4f} ms a layer", flush=True)
        print(f"{shape}: [F, N] - [N, F] = {sums['[F, N]'] - sums['[N, F]']:+.4f} ms a layer", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
