"""grad_norm_partial / grad_norm_final / grad_scale: global-norm clipping (kernels/grad_norm.cu). The
flat gradient is cut into GRAD_NORM_PARTIALS contiguous chunks; each chunk's sum of squares is one
partial, and the partials are summed in index order: deterministic."""

from __future__ import annotations

import numpy as np

from andrea.memory import GRAD_NORM_PARTIALS
from andrea.ops.base import ELEMENTWISE_THREADS, Draw, OpCase, blocks

KERNELS = {"grad_norm": ("k_grad_norm_partial", "k_grad_norm_final", "k_grad_scale")}
NORM_THREADS = 512  # threads of a partial's block; its sum order, so the bits, follow from it


def engine_buffers() -> tuple:
    return ()


class NumpyOps:
    def grad_norm_partial(self, partials, grads):
        chunk = -(-grads.size // partials.size)
        for i in range(partials.size):
            g = grads[i * chunk:(i + 1) * chunk]
            partials[i] = np.dot(g, g)

    def grad_norm_final(self, norm, partials):
        norm[0] = np.sqrt(partials.sum())

    def grad_scale(self, grads, scale):
        grads *= grads.dtype.type(scale)


class CudaOps:
    def grad_norm_partial(self, partials, grads):
        chunk = -(-grads.size // partials.size)
        self._launch("k_grad_norm_partial", partials.size, NORM_THREADS,
                     partials, grads, np.int64(grads.size), np.int64(chunk))

    def grad_norm_final(self, norm, partials):
        self._launch("k_grad_norm_final", 1, NORM_THREADS, norm, partials, np.int32(partials.size))

    def grad_scale(self, grads, scale):
        self._launch("k_grad_scale", blocks(grads.size, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS,
                     grads, np.float32(scale), np.int64(grads.size))


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    partials = GRAD_NORM_PARTIALS
    return {"grad_norm_partial": (2 * n_params, 4 * n_params), "grad_norm_final": (partials, 4 * partials),
            "grad_scale": (n_params, 8 * n_params)}[call]


CASES = ("grad_norm",)
OVERWRITE_CASES = ()


def case(name: str, s, draw: Draw) -> OpCase:
    a = {"grads": draw.randn(s.n_params, scale=1e-3), "partials": draw.nan(GRAD_NORM_PARTIALS), "norm": draw.nan(1)}

    def run(E, x):
        E.grad_norm_partial(x["partials"], x["grads"])
        E.grad_norm_final(x["norm"], x["partials"])
        E.grad_scale(x["grads"], 0.37)

    return OpCase(a, run, ("partials", "norm", "grads"))
