"""adamw_step: one AdamW update of the flat weights (kernels/adamw.cu), weight decay only inside the
layout's decay ranges; under mixed precision the same pass writes the 16-bit weight copy the products
read (`cast` builds it at load), a pure function of the FP32 weights, so resume stays bit-exact. Under
precision fp8 it also takes the amax of that copy's matrices for their FP8 casts (ops/fp8.py,
prepare_fp8_weights), which then need no amax pass of their own."""

from __future__ import annotations

import numpy as np

from andrea.common.errors import AndreaError
from andrea.spec.memory import BufferSpec
from andrea.ops.base import ELEMENTWISE_THREADS, Draw, OpCase, blocks

KERNELS = {"adamw": ("k_adamw", "k_cast_params")}
MAX_DECAY_RANGES = 1024


def engine_buffers() -> tuple[BufferSpec, ...]:
    """The decay ranges as (start, end) pairs on the device, uploaded when they change."""
    return (BufferSpec("decay_ranges", (2 * MAX_DECAY_RANGES,), "int64", "engine"),)


class NumpyOps:
    def cast(self, dst, src) -> None:
        """dst = src in dst's dtype (the low-precision weight copy of mixed precision)."""
        dst[...] = src

    def adamw_step(self, params, grads, m, v, *, lr, beta1, beta2, eps, weight_decay, step, decay_ranges,
                   params_lp=None, grad_scales=(1.0, 1.0), gate=None):
        """One AdamW update; `step` is 1-based (bias correction); decay only inside decay_ranges.
        `params_lp`, when given, receives the updated weights in its own dtype. The gradient is read as
        grads x grad_scales[0] x grad_scales[1] (the step's mean, then the clipping), each product rounded.
        `gate` (grad_gate's): grad_scales[1] is gate[0], and gate[1] == 0 leaves everything as it is."""
        if gate is not None:
            if gate[1] == 0:
                return
            grad_scales = (grad_scales[0], float(gate[0]))
        t = self.dtype.type
        for scale in grad_scales:
            if scale != 1.0:
                grads = grads * t(scale)
        m *= t(beta1)
        m += t(1 - beta1) * grads
        v *= t(beta2)
        v += t(1 - beta2) * grads * grads
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        update = (m / t(bc1)) / (np.sqrt(v / t(bc2)) + t(eps))
        for start, end in decay_ranges:
            update[start:end] += t(weight_decay) * params[start:end]
        params -= t(lr) * update
        if params_lp is not None:
            self.cast(params_lp, params)


class CudaOps:
    def cast(self, dst, src) -> None:
        """dst = src in dst's dtype: the low-precision weight copy, built from the FP32 weights."""
        self.launch("k_cast_params", blocks(dst.size, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS,
                    dst, src, np.int64(dst.size))

    def adamw_step(self, params, grads, m, v, *, lr, beta1, beta2, eps, weight_decay, step, decay_ranges,
                   params_lp=None, grad_scales=(1.0, 1.0), gate=None):
        """One AdamW update; `step` is 1-based (bias correction); decay only inside decay_ranges.
        `params_lp`, when given, receives the updated weights in its own dtype in the same pass. The gradient
        is read as grads x grad_scales[0] x grad_scales[1], each product rounded: the bits of scaling passes
        over grads before the update, without them. `gate` (grad_gate's, on the device): the kernel reads
        grad_scales[1] from gate[0], and leaves everything as it is where gate[1] == 0."""
        table = self.own["decay_ranges"]
        ranges = tuple((int(s), int(e)) for s, e in decay_ranges)
        if ranges != self._decay_ranges:
            if len(ranges) > MAX_DECAY_RANGES:
                raise AndreaError(f"{len(ranges)} weight-decay ranges; the CUDA engine takes at most {MAX_DECAY_RANGES}")
            if ranges:
                table[:2 * len(ranges)].set(np.array(ranges, dtype=np.int64).reshape(-1))
            self._decay_ranges = ranges
        f32 = np.float32
        self.launch("k_adamw", blocks(-(-params.size // 4), ELEMENTWISE_THREADS), ELEMENTWISE_THREADS,
                    params, grads, m, v, np.int64(params.size), table, np.int32(len(ranges)),
                    f32(lr), f32(beta1), f32(1 - beta1), f32(beta2), f32(1 - beta2), f32(eps),
                    f32(weight_decay), f32(1 - beta1**step), f32(1 - beta2**step),
                    params if params_lp is None else params_lp, np.int32(params_lp is not None),
                    *(f32(x) for x in grad_scales), np.uint64(0) if gate is None else gate,
                    *self.fp8_book.weight_amax_rows(params_lp))


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    return {"adamw_step": (18 * n_params, 4 * 7 * n_params + (f if f < 4 else 0) * n_params),
            "cast": (n_params, (4 + f) * n_params)}[call]


CASES = ("adamw", "adamw_scaled")
OVERWRITE_CASES = ()


def case(name: str, s, draw: Draw) -> OpCase:
    """adamw_scaled: the gradient read through the step's mean and a clipping's scale."""
    n = s.n_params
    a = {"params": draw.randn(n, scale=0.02), "grads": draw.randn(n, scale=1e-3),
         "m": draw.randn(n, scale=1e-4), "v": np.abs(draw.randn(n, scale=1e-6)), "params_lp": draw.nan(n)}
    scales = (0.5, 0.37) if name == "adamw_scaled" else (1.0, 1.0)

    def run(E, x):
        E.adamw_step(x["params"], x["grads"], x["m"], x["v"], lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                     weight_decay=0.1, step=7, decay_ranges=list(s.decay_ranges), params_lp=x["params_lp"],
                     grad_scales=scales)

    return OpCase(a, run, ("params", "m", "v", "params_lp", "grads"), act=("params_lp",))
