"""What every op module shares: the NumPy engine's `+=`/overwrite rule, the CUDA launch helpers, the
`#define`s a kernel file exports to its launcher, and the cross-check case format.

An op module (`andrea/ops/<op>.py`, beside `kernels/<op>.cu`) holds one op pair whole: `NumpyOps` and
`CudaOps`, the two engines' halves (mixed into NumpyEngine and CudaEngine), `KERNELS` (its kernel files
and their kernels), optionally `HOPPER_KERNELS` (the kernels a file's sm_90a build adds), `ENGINE_BUFFERS` (device buffers the CUDA half keeps for the memory plan), `cost()`
(FLOPs and fewest bytes of each call) and `case()` (its cross-check against the float64 reference).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from andrea.common.errors import AndreaError
from andrea.spec.layout import ParameterLayout

# Threads of a block of the grid-stride and one-thread-per-vector kernels: a host choice, not a kernel
# constant (those kernels take any block size).
ELEMENTWISE_THREADS = 256


# ---- NumPy -----------------------------------------------------------------------------------
def start_grad(grad, overwrite: bool) -> None:
    """A backward op's input or weight gradient: added into, or with `overwrite` written (started from zero
    here)."""
    if overwrite:
        grad[...] = 0


# ---- CUDA ------------------------------------------------------------------------------------
def ptr(a) -> int:
    return a.data.ptr


def overlaps(a_ptr: int, a_bytes: int, b_ptr: int, b_bytes: int) -> bool:
    """Whether two spans of device memory, (address, bytes) each, share a byte."""
    return a_ptr < b_ptr + b_bytes and b_ptr < a_ptr + a_bytes


def blocks(n: int, threads: int) -> int:
    return max(1, -(-n // threads))


_DEFINE = re.compile(r"^\s*#define\s+([A-Z][A-Z0-9_]*)\s+(\d+)\b", re.MULTILINE)


@functools.cache
def kernel_defines(op: str) -> dict[str, int]:
    """The integer `#define`s of kernels/<op>.cu: the launch shape its kernels are written for, read by
    their launcher so that no constant is copied by hand. A name defined twice is refused (it would be
    defined under a condition this reader does not evaluate)."""
    from andrea.ops.kernels_build import kernel_dir

    path = kernel_dir() / f"{op}.cu"
    found: dict[str, int] = {}
    for name, value in _DEFINE.findall(path.read_text()):
        if name in found:
            raise AndreaError(f"{path}: #define {name} appears twice; its launcher cannot tell which one holds")
        found[name] = int(value)
    return found


# ---- cross-checks ----------------------------------------------------------------------------
@dataclass(frozen=True)
class OpShape:
    B: int
    T: int
    C: int
    H: int
    V: int
    n_params: int
    decay_ranges: tuple

    @classmethod
    def of(cls, shape, B: int, T: int | None = None) -> "OpShape":
        layout = ParameterLayout(shape)
        return cls(B, T or shape.seq_len, shape.d_model, shape.n_head, shape.vocab_size, layout.n_params,
                   tuple(layout.decay_ranges()))


@dataclass
class OpCase:
    arrays: dict  # host inputs and starting outputs: float64, or int32 for token ids
    run: Callable  # run(engine, arrays) -> dict of scalars: the forward, then the backward
    checked: tuple  # arrays compared after run
    # Arrays in the engine's activation dtype (act_dtype: bf16 under mixed precision); the rest are float.
    act: tuple = ()
    # For an engine whose attention saves the logsumexp (attention = "lse"): its own starting arrays,
    # and the references that replace the NumPy engine's for it, computed from the inputs.
    lse_arrays: dict = field(default_factory=dict)
    lse_reference: Callable | None = None


class Draw:
    """Fresh random inputs of a case. Never zeros: gradients start random (backward ops add into them),
    and every buffer an op overwrites starts as NaN, so an element it fails to write shows up."""

    def __init__(self, rng, overwrite: bool = False):
        self.rng = rng
        self.overwrite = overwrite

    def randn(self, *shape, scale=1.0):
        return self.rng.standard_normal(shape) * scale

    @staticmethod
    def nan(*shape):
        return np.full(shape, np.nan)

    def grad(self, *shape):
        """An input or weight gradient: added into (random start) or, for an overwrite case, written (NaN start:
        overwrite writes the input gradients, overwrite_weights the weight gradients a step's first micro-batch
        writes)."""
        return self.nan(*shape) if self.overwrite else self.randn(*shape)

    def tokens(self, B, T, V):
        """Random ids, half of them from 8 values: many repeats for the embedding backward."""
        ids = self.rng.integers(0, V, (B, T))
        few = self.rng.integers(0, V, 8)
        pick = self.rng.random((B, T)) < 0.5
        ids[pick] = few[self.rng.integers(0, 8, int(pick.sum()))]
        return ids.astype(np.int32)
