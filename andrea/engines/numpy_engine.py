"""NumPy reference engine: the oracle every other engine is checked against.

The ops are the `NumpyOps` halves of andrea/ops/<op>.py; this class adds the buffers around them.
Shapes: B micro-batch, T sequence, C model width, H heads, V vocab. Activations are row-major
[B, T, C]; qkv is [3, B, T, C] (Q, K, V stacked); attention probabilities are [B, H, T, T].
"""

from __future__ import annotations

from math import prod

import numpy as np

from andrea.engines.cpu_blas import BlockedProducts
from andrea.engines.protocol import EngineTraits
from andrea.spec.memory import PERSISTENT_ROLES, carve, split_shared
from andrea.ops import adamw, attn, attn_out, attn_qkv, embed, grad_norm, layernorm, loss, mlp, residual_add


ARENA_ALIGN = 64  # bytes: each transient buffer's start in its byte array


class NumpyEngine(embed.NumpyOps, layernorm.NumpyOps, attn_qkv.NumpyOps, attn.NumpyOps, attn_out.NumpyOps,
                  mlp.NumpyOps, residual_add.NumpyOps, loss.NumpyOps, grad_norm.NumpyOps, adamw.NumpyOps):
    name = "numpy"
    xp = np

    def __init__(self, dtype: str = "float32", threads: int | None = None):
        self.dtype = np.dtype(dtype)
        # act_dtype names the plan's float: a float64 engine allocates every float32 buffer of it in float64
        self.traits = EngineTraits(attention="probs", act_dtype="float32", loss_scaling=False, graphs=False)
        # every product through fixed blocks on one-thread BLAS: bytes independent of the thread count
        self.products = BlockedProducts(threads)
        self.mm = self.products.matmul

    @staticmethod
    def fp8_operand(a, fmt: str, amax: float | None = None):
        """What a product of attn_qkv, attn_out, mlp or the classifier reads of `a`: `a` itself (the fp8 emulation
        rounds it, at the scale of `amax` where given)."""
        return a

    def allocate(self, plan, share=None):
        """The plan's buffers, zero-filled: the kept ones each on its own, the transient ones carved from one
        byte array; with `share` = (buffers, plan) of another model, the weights are that model's and the
        transient buffers are carved from its byte array (the `.base` of each transient view; as
        CudaEngine.allocate)."""
        if share is not None:
            other_bufs, other_plan = share
            bufs, transient = split_shared(plan, other_bufs, other_plan)
            arena = next(other_bufs[b.name].base for b in other_plan.buffers if b.role not in PERSISTENT_ROLES)
        else:
            bufs = {b.name: np.zeros(b.shape, dtype=self._dtype(b)) for b in plan.buffers if b.role in PERSISTENT_ROLES}
            transient = [b for b in plan.buffers if b.role not in PERSISTENT_ROLES]
        _, offsets, total = carve(transient, lambda b: prod(b.shape) * self._dtype(b).itemsize, ARENA_ALIGN)
        if share is None:
            arena = np.zeros(total, dtype=np.uint8)
        elif total > arena.size:
            raise ValueError(f"the transient buffers need {total:,} bytes, the shared model's span has {arena.size:,}")
        for b, off in zip(transient, offsets):
            n = prod(b.shape) * self._dtype(b).itemsize
            bufs[b.name] = arena[off: off + n].view(self._dtype(b)).reshape(b.shape)
        return {b.name: bufs[b.name] for b in plan.buffers}

    def _dtype(self, b) -> np.dtype:
        """A float64 engine runs the whole plan in float64."""
        return self.dtype if b.dtype == "float32" else np.dtype(b.dtype)

    def to_host(self, a, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return np.asarray(a)
        np.copyto(out, a, casting="same_kind")  # the float64 engine's buffers into float32 ones
        return out

    def upload(self, dst, src, staged: bool = False) -> None:
        dst[...] = src

    def synchronize(self) -> None:
        pass

    def zero(self, buf) -> None:
        buf.fill(0)

    zero_grads = zero
