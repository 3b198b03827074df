"""Every matrix product of one ANDREA training step, timed alone through the CUDA engine's cuBLAS handle.

    PYTHONPATH=. python3 scripts/bench_gemm.py [--shape 120M] [--batch 8] [--precision bf16] [--lt] [--fp8] [--split-k]

Each product runs 20 times inside one CUDA graph (no host launch cost in the numbers); the table gives
the median time per product over 5 graph launches and the rate it reaches. Run on a CUDA machine.
--lt also times each product through cuBLASLt, every algorithm its heuristic offers (up to 8), against the
engine's cublasGemmEx; --fp8 times each product's shape on FP8 operands through cuBLASLt (E4M3 x E4M3 for
the forward products, E5M2 gradients x E4M3 for the backward ones; both operands K-major, as Hopper's FP8
products take them), with the output type the engine writes there. --split-k times each single weight
gradient (k = the tokens) split along k in 2, 4 and 8 chunks: one strided batched product into fp32 partials
and their sum, with its relative difference from the plain product.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from andrea.spec.config import ModelShape  # noqa: E402
from andrea.ops.fp8 import amax_arg  # noqa: E402
from andrea.schedule.timing import graph_ms  # noqa: E402

REPEATS = 20


def products(shape: ModelShape, B: int) -> list[tuple]:
    """(name, m, n, k, trans_a, trans_b, batch, output is fp32) of each product, as the engine calls them."""
    C, V, N, F = shape.d_model, shape.vocab_size, B * shape.seq_len, 4 * shape.d_model
    return [
        ("qkv fwd (x3 batched)", N, C, C, False, False, 3, False),
        ("attn_out fwd", N, C, C, False, False, 1, False),
        ("mlp up fwd", N, F, C, False, False, 1, False),
        ("mlp down fwd", N, C, F, False, False, 1, False),
        ("classifier fwd", N, V, C, False, True, 1, False),
        ("classifier dwte", V, C, N, True, False, 1, True),
        ("classifier dinp", N, C, V, False, False, 1, True),
        ("mlp down dW", F, C, N, True, False, 1, True),
        ("mlp down dinp", N, F, C, False, True, 1, False),
        ("mlp up dW", C, F, N, True, False, 1, True),
        ("mlp up dinp", N, C, F, False, True, 1, True),
        ("attn_out dW", C, C, N, True, False, 1, True),
        ("attn_out dinp", N, C, C, False, True, 1, False),
        ("qkv dW (x3 batched)", C, C, N, True, False, 3, True),
        ("qkv dinp (one of 3)", N, C, C, False, True, 1, True),
    ]


def timed_ms(engine, fn) -> float:
    """Median time of one fn(), recorded REPEATS times in one CUDA graph (andrea.schedule.timing.graph_ms)."""
    return graph_ms(engine, fn, reps=5, inner=REPEATS)


def lt_algorithms(engine, c, a, b, m, n, k, ta, tb, beta) -> list[float]:
    """Each cuBLASLt algorithm's time for the product (the heuristic's order; empty where it offers none)."""
    lt = engine.blas_lt
    kw = dict(trans_a=ta, trans_b=tb)
    return [round(timed_ms(engine, lambda i=i: lt.gemm(c, a, b, m, n, k, algo=i, beta=beta, **kw)), 4)
            for i in range(lt.algorithms(c, a, b, m, n, k, **kw))]


def fp8_ms(engine, m, n, k, out32, rng, backward: bool) -> float | None:
    """The product C[m, n] = A[m, k] @ B[n, k]^T on FP8 operands with unit scales (None where cuBLASLt has
    no algorithm): A E5M2 for a backward product (a gradient), else E4M3; B E4M3."""
    import cupy

    from andrea.ops.fp8 import ml_dtype

    a_type = "e5m2" if backward else "e4m3"
    a = cupy.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(ml_dtype(a_type)).view(np.uint8))
    b = cupy.asarray(rng.standard_normal((n, k), dtype=np.float32).astype(ml_dtype("e4m3")).view(np.uint8))
    c = cupy.asarray(rng.standard_normal((m, n), dtype=np.float32).astype("float32" if out32 else "bfloat16"))
    one = cupy.ones(1, dtype=np.float32)
    kw = dict(trans_b=True, a_type=a_type, b_type="e4m3", a_scale=one, b_scale=one, beta=1.0 if out32 else 0.0)
    if not engine.blas_lt.gemm(c, a, b, m, n, k, **kw):
        return None
    return round(timed_ms(engine, lambda: engine.blas_lt.gemm(c, a, b, m, n, k, **kw)), 4)


SPLITS = (2, 4, 8)


def split_k_ms(engine, c, a, b, m, n, k, splits: int) -> tuple[float, float]:
    """A weight gradient C[m, n] += A^T B (A [k, m], B [k, n], k the tokens) with k split in `splits` chunks: one
    strided batched product into fp32 partials, then their sum added into C by a product with a ones vector
    (a fixed order). Its time, and its relative difference from the plain product."""
    import cupy

    part = cupy.zeros((splits, m, n), dtype=np.float32)
    ones = cupy.ones((splits, 1), dtype=np.float32)
    chunk = k // splits

    def run():
        engine.blas.gemm(part, a, b, m, n, chunk, trans_a=True, batch=splits, stride_a=chunk * m, stride_b=chunk * n,
                         stride_c=m * n)
        engine.blas.gemm(c, part, ones, m * n, 1, splits, trans_a=True, beta=1.0)

    ms = timed_ms(engine, run)
    ref = cupy.zeros((m, n), dtype=np.float32)
    engine.blas.gemm(ref, a, b, m, n, k, trans_a=True, beta=1.0)
    c[...] = 0
    run()
    return ms, float(cupy.linalg.norm(c - ref) / cupy.linalg.norm(ref))


def gelu_epilogues(engine, shape: ModelShape, B: int, rng) -> list[dict]:
    """The MLP's two GELU products both ways: cuBLASLt's epilogue, or the plain product and the GELU kernel."""
    import cupy

    C, N, F = shape.d_model, B * shape.seq_len, 4 * shape.d_model
    act = engine.traits.act_dtype
    x = {name: cupy.asarray(rng.standard_normal(s, dtype=np.float32).astype(act))
         for name, s in (("inp", (N, C)), ("W_1", (C, F)), ("W_2", (F, C)), ("pre", (N, F)), ("out", (N, F)))}
    blocks = engine.vec_blocks(N * F)
    kernel = {"gelu_aux": "k_mlp_fwd", "dgelu": "k_mlp_bwd"}
    cases = {"gelu_aux": ("inp", "W_1", False), "dgelu": ("inp", "W_2", True)}  # dgelu: dout [N, C] @ W_2^T
    rows = []
    for epi, (a, b, tb) in cases.items():
        kw = dict(trans_b=tb, epilogue=epi, aux=x["pre"])
        lt = timed_ms(engine, lambda: engine.blas_lt.gemm(x["out"], x[a], x[b], N, F, C, **kw))
        # every algorithm the heuristic offers for the epilogue product, in its order (the engine runs the first)
        algos = [round(timed_ms(engine, lambda i=i: engine.blas_lt.gemm(x["out"], x[a], x[b], N, F, C, algo=i, **kw)), 4)
                 for i in range(engine.blas_lt.algorithms(x["out"], x[a], x[b], N, F, C, **kw))]
        plain = timed_ms(engine, lambda: engine.blas.gemm(x["out"], x[a], x[b], N, F, C, trans_b=tb))
        pass_ms = timed_ms(engine, lambda: engine.launch(kernel[epi], blocks, 256, x["out"], x["pre"], np.int64(N * F),
                                                         amax_arg(None)))
        rows.append({"epilogue": epi, "lt_ms": round(lt, 4), "lt_algos_ms": algos, "plain_ms": round(plain, 4),
                     "kernel_ms": round(pass_ms, 4)})
        print(f"mlp {epi:9} cuBLASLt epilogue {lt:.4f} ms (its algorithms {' '.join(f'{t:.4f}' for t in algos)}); "
              f"plain product {plain:.4f} + {kernel[epi]} {pass_ms:.4f} = {plain + pass_ms:.4f} ms", flush=True)
    return rows


def main() -> int:
    import cupy

    from andrea.engines.cuda_engine import CudaEngine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="120M", choices=("12M", "120M"))
    parser.add_argument("--batch", type=int, default=None, help="micro-batch (default: 8 for 120M, 32 for 12M)")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "tf32", "bf16"))
    parser.add_argument("--lt", action="store_true", help="also every cuBLASLt algorithm for each product")
    parser.add_argument("--fp8", action="store_true", help="also each product's shape on FP8 operands")
    parser.add_argument("--split-k", action="store_true",
                        help=f"also each single weight gradient with its tokens split in {SPLITS} chunks")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    raw = json.loads((REPO / "config" / "experiments" / f"ANDREA-{args.shape}-TRAIN.json").read_text())
    shape = ModelShape(**raw["model"])
    B = args.batch or {"120M": 8, "12M": 32}[args.shape]
    engine = CudaEngine(precision=args.precision)
    act = engine.traits.act_dtype
    rng = np.random.default_rng(0)
    rows = []
    for name, m, n, k, ta, tb, batch, out32 in products(shape, B):
        a_shape = (k, m) if ta else (m, k)
        b_shape = (batch, n, k) if tb else (batch, k, n)
        a = cupy.asarray(rng.standard_normal(a_shape, dtype=np.float32).astype(act))
        b = cupy.asarray(rng.standard_normal(b_shape, dtype=np.float32).astype(act))
        c = cupy.asarray(rng.standard_normal((batch, m, n), dtype=np.float32).astype("float32" if out32 else act))
        kw = dict(trans_a=ta, trans_b=tb, beta=1.0 if out32 else 0.0)
        if batch > 1:
            kw.update(batch=batch, stride_a=0, stride_b=b[0].size, stride_c=c[0].size)
        ms = timed_ms(engine, lambda: engine.blas.gemm(c, a, b, m, n, k, **kw))
        flops = 2 * m * n * k * batch
        row = {"product": name, "m": m, "n": n, "k": k, "batch": batch, "ms": round(ms, 4),
               "tflop_s": round(flops / ms / 1e9, 1)}
        line = f"{name:24} {m:>6} x {n:>6} x {k:>6} (x{batch})  {ms:8.4f} ms  {flops / ms / 1e9:6.1f} TFLOP/s"
        if args.lt and batch == 1:
            lt = lt_algorithms(engine, c[0], a, b[0], m, n, k, ta, tb, kw["beta"])
            row["lt_ms"] = lt
            if lt:
                line += f" | cuBLASLt algos {' '.join(f'{t:.4f}' for t in lt)}"
        if args.split_k and batch == 1 and name.endswith("dW"):
            splits = {n_: split_k_ms(engine, c[0], a, b[0], m, n, k, n_) for n_ in SPLITS}
            row["split_k"] = {n_: {"ms": round(t, 4), "rel_diff": d} for n_, (t, d) in splits.items()}
            line += " | split-K " + " ".join(f"{n_}: {t:.4f} ({d:.0e})" for n_, (t, d) in splits.items())
        if args.fp8:
            # a batch of 3 (Q, K, V) is one product of 3n columns
            f8 = fp8_ms(engine, m, n * batch, k, out32, rng, backward=any(w in name for w in ("dW", "dinp", "dwte")))
            row["fp8_ms"] = f8
            if f8:
                line += f" | fp8 {f8:.4f} ms {flops / f8 / 1e9:6.1f} TFLOP/s ({ms / f8:.2f}x)"
        rows.append(row)
        print(line, flush=True)
    if engine.blas_lt:
        rows += gelu_epilogues(engine, shape, B, rng)
    total = sum(r["ms"] * (3 if "one of 3" in r["product"] else 1) for r in rows if "m" in r)
    print(f"per layer-step total of these products (classifier once): see rows; all rows summed {total:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
