"""NumPy reference engine: the oracle every other engine is checked against.

The ops are the `NumpyOps` halves of andrea/ops/<op>.py; this class adds the buffers around them.
Shapes: B micro-batch, T sequence, C model width, H heads, V vocab. Activations are row-major
[B, T, C]; qkv is [3, B, T, C] (Q, K, V stacked); attention probabilities are [B, H, T, T].
"""

from __future__ import annotations

import numpy as np

from andrea.engines.cpu_blas import BlockedProducts
from andrea.engines.protocol import EngineTraits
from andrea.ops import adamw, attn, attn_out, attn_qkv, embed, grad_norm, layernorm, loss, mlp, residual_add


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

    def allocate(self, plan):
        dt = {"float32": self.dtype}  # a float64 engine runs the whole plan in float64
        return {b.name: np.zeros(b.shape, dtype=dt.get(b.dtype, np.dtype(b.dtype))) for b in plan.buffers}

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def upload(self, dst, src) -> None:
        dst[...] = src

    def synchronize(self) -> None:
        pass

    def zero(self, buf) -> None:
        buf.fill(0)

    zero_grads = zero
