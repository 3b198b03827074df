"""grad_norm_partial / grad_norm_final: the global norm for clipping (kernels/grad_norm.cu). The flat gradient is
cut into GRAD_NORM_PARTIALS contiguous chunks; each chunk's sum of squares is one partial, and the partials are
summed in index order: deterministic. The partials take the gradient times `scale` (the step's mean over
micro-batches, or a loss scale's undoing), each product rounded to float32 as a pass scaling the gradient in
place would round it: AdamW applies the same scale (and the clipping's) as it reads the gradient, so the
gradient itself is never rewritten."""

from __future__ import annotations

import numpy as np

from andrea.memory import GRAD_NORM_PARTIALS
from andrea.ops.base import Draw, OpCase

KERNELS = {"grad_norm": ("k_grad_norm_partial", "k_grad_norm_final")}
NORM_THREADS = 512  # threads of a partial's block; its sum order, so the bits, follow from it


def engine_buffers() -> tuple:
    return ()


class NumpyOps:
    def grad_norm_partial(self, partials, grads, scale=1.0):
        chunk = -(-grads.size // partials.size)
        s = grads.dtype.type(scale)
        for i in range(partials.size):
            g = grads[i * chunk:(i + 1) * chunk]
            if scale != 1.0:
                g = g * s
            partials[i] = np.dot(g, g)

    def grad_norm_final(self, norm, partials):
        norm[0] = np.sqrt(partials.sum())


class CudaOps:
    def grad_norm_partial(self, partials, grads, scale=1.0):
        chunk = -(-grads.size // partials.size)
        self._launch("k_grad_norm_partial", partials.size, NORM_THREADS,
                     partials, grads, np.float32(scale), np.int64(grads.size), np.int64(chunk))

    def grad_norm_final(self, norm, partials):
        self._launch("k_grad_norm_final", 1, NORM_THREADS, norm, partials, np.int32(partials.size))


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    partials = GRAD_NORM_PARTIALS
    return {"grad_norm_partial": (3 * n_params, 4 * n_params), "grad_norm_final": (partials, 4 * partials)}[call]


CASES = ("grad_norm",)
OVERWRITE_CASES = ()


def case(name: str, s, draw: Draw) -> OpCase:
    a = {"grads": draw.randn(s.n_params, scale=1e-3), "partials": draw.nan(GRAD_NORM_PARTIALS), "norm": draw.nan(1),
         "scaled_partials": draw.nan(GRAD_NORM_PARTIALS), "scaled_norm": draw.nan(1)}

    def run(E, x):
        E.grad_norm_partial(x["partials"], x["grads"])
        E.grad_norm_final(x["norm"], x["partials"])
        E.grad_norm_partial(x["scaled_partials"], x["grads"], scale=0.37)
        E.grad_norm_final(x["scaled_norm"], x["scaled_partials"])

    return OpCase(a, run, ("partials", "norm", "scaled_partials", "scaled_norm", "grads"))
