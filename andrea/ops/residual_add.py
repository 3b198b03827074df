"""residual_add / residual_add_bwd: the residual connection, out = a + b (kernels/residual_add.cu). The
model runs it fused into the LayerNorm beside it (andrea/ops/layernorm.py); the pair stays, checked."""

from __future__ import annotations

import numpy as np

from andrea.ops.base import ELEMENTWISE_THREADS, Draw, OpCase

KERNELS = {"residual_add": ("k_residual_add", "k_residual_add_bwd")}


def engine_buffers() -> tuple:
    return ()


class NumpyOps:
    def residual_add(self, out, a, b):
        np.add(a, b, out=out)

    def residual_add_bwd(self, da, db, dout):
        da += dout
        db += dout


class CudaOps:
    def residual_add(self, out, a, b):
        self.fp8_book.wrote(out)
        self.launch("k_residual_add", self.vec_blocks(out.size), ELEMENTWISE_THREADS, out, a, b, np.int64(out.size))

    def residual_add_bwd(self, da, db, dout):
        self.fp8_book.wrote(da, db)
        self.launch("k_residual_add_bwd", self.vec_blocks(dout.size), ELEMENTWISE_THREADS,
                    da, db, dout, np.int64(dout.size))


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    N = B * T
    return {"residual_add": (N * C, f * 3 * N * C), "residual_add_bwd": (2 * N * C, f * 5 * N * C)}[call]


CASES = ("residual_add",)
OVERWRITE_CASES = ()


def case(name: str, s, draw: Draw) -> OpCase:
    B, T, C = s.B, s.T, s.C
    a = {"a": draw.randn(B, T, C), "b": draw.randn(B, T, C), "out": draw.nan(B, T, C),
         "da": draw.randn(B, T, C), "db": draw.randn(B, T, C), "dout": draw.randn(B, T, C)}

    def run(E, x):
        E.residual_add(x["out"], x["a"], x["b"])
        E.residual_add_bwd(x["da"], x["db"], x["dout"])

    return OpCase(a, run, ("out", "da", "db"), act=("a", "b", "out", "db"))
