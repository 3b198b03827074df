"""grad_norm_partial / grad_norm_final: the global norm for clipping (kernels/grad_norm.cu). The flat gradient is
cut into GRAD_NORM_PARTIALS contiguous chunks; each chunk's sum of squares is one partial, and the partials are
summed in index order: deterministic. The partials take the gradient times `scale` (the step's mean over
micro-batches, or a loss scale's undoing), each product rounded to float32 as a pass scaling the gradient in
place would round it: AdamW applies the same scale (and the clipping's) as it reads the gradient, so the
gradient itself is never rewritten.

grad_gate turns the norm into the clipping scale and, with the micro-batches' loss sums (ops/loss.py,
loss_sums), says whether the step updates (norm and losses finite), on the engine: AdamW reads both there
(adamw_step's `gate`), so a training step launches its update without waiting for the host."""

from __future__ import annotations

import math

import numpy as np

from andrea.spec.memory import GRAD_NORM_PARTIALS
from andrea.ops.base import Draw, OpCase

KERNELS = {"grad_norm": ("k_grad_norm_partial", "k_grad_norm_final", "k_grad_gate")}
NORM_THREADS = 512  # threads of a partial's block; its sum order, so the bits, follow from it


def engine_buffers() -> tuple:
    return ()


def clip_scale(norm: float, clip: float) -> float:
    """Global-norm clipping's scale of the gradient: clip / (norm + 1e-6) where clip > 0 and norm > clip, else 1
    (k_grad_gate computes the same, in double from the float norm)."""
    return clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0


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

    def grad_gate(self, gate, norm, n_losses: int, clip: float):
        """gate[0]: the clipping scale, clip / (norm + 1e-6) where clip > 0 and norm > clip, else 1; gate[1]: 1 where
        the norm and the loss sums of slots 0 .. n_losses - 1 are finite (the step updates), else 0."""
        g = float(norm[0])
        finite = math.isfinite(g) and bool(np.isfinite(self.read_loss_sums(n_losses)[:, 0]).all())
        gate[0] = clip_scale(g, clip)
        gate[1] = 1.0 if finite else 0.0


class CudaOps:
    def grad_norm_partial(self, partials, grads, scale=1.0):
        chunk = -(-grads.size // partials.size)
        self.launch("k_grad_norm_partial", partials.size, NORM_THREADS,
                    partials, grads, np.float32(scale), np.int64(grads.size), np.int64(chunk))

    def grad_norm_final(self, norm, partials):
        self.launch("k_grad_norm_final", 1, NORM_THREADS, norm, partials, np.int32(partials.size))

    def grad_gate(self, gate, norm, n_losses: int, clip: float):
        self.launch("k_grad_gate", 1, NORM_THREADS, gate, norm, self.own["loss_sums"], np.int32(n_losses),
                    np.float64(clip))


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    partials = GRAD_NORM_PARTIALS
    return {"grad_norm_partial": (3 * n_params, 4 * n_params), "grad_norm_final": (partials, 4 * partials)}[call]


CASES = ("grad_norm", "grad_gate")
OVERWRITE_CASES = ()


def case(name: str, s, draw: Draw) -> OpCase:
    if name == "grad_gate":
        return _gate_case(s, draw)
    a = {"grads": draw.randn(s.n_params, scale=1e-3), "partials": draw.nan(GRAD_NORM_PARTIALS), "norm": draw.nan(1),
         "scaled_partials": draw.nan(GRAD_NORM_PARTIALS), "scaled_norm": draw.nan(1)}

    def run(E, x):
        E.grad_norm_partial(x["partials"], x["grads"])
        E.grad_norm_final(x["norm"], x["partials"])
        E.grad_norm_partial(x["scaled_partials"], x["grads"], scale=0.37)
        E.grad_norm_final(x["scaled_norm"], x["scaled_partials"])

    return OpCase(a, run, ("partials", "norm", "scaled_partials", "scaled_norm", "grads"))


def _gate_case(s, draw: Draw) -> OpCase:
    """The gate over three micro-batches' loss sums (one weighted): a norm over the clip (its scale), under it (1),
    and with a non-finite loss in the last slot (no update)."""
    B, T = s.B, s.T
    weights = (draw.rng.random((B, T)) < 0.5).astype(np.float64)
    bad = np.abs(draw.randn(B, T)) + 0.5
    bad[B - 1, T - 1] = np.inf
    norm = np.abs(draw.randn(1)) + 2.0
    a = {"losses": np.abs(draw.randn(B, T)) + 0.5, "weighted": np.abs(draw.randn(B, T)) + 0.5, "weights": weights,
         "bad": bad, "norm": norm, "clipped": draw.nan(2), "unclipped": draw.nan(2), "stopped": draw.nan(2)}
    clip = float(norm[0]) * 0.37

    def run(E, x):
        E.loss_sums(x["losses"], slot=0)
        E.loss_sums(x["weighted"], x["weights"], slot=1)
        E.grad_gate(x["clipped"], x["norm"], 2, clip)
        E.grad_gate(x["unclipped"], x["norm"], 2, 3.0 * clip)
        E.loss_sums(x["bad"], slot=2)
        E.grad_gate(x["stopped"], x["norm"], 3, clip)

    return OpCase(a, run, ("clipped", "unclipped", "stopped"))
