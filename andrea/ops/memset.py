"""memset: the kernel that stands for a recorded graph's small memset nodes (kernels/memset.cu; the rewrite is
andrea/engines/graphs.py), and that clears the FP8 weight slots' amax words (ops/fp8.py). No op pair: no op of
the model is it, so it has no case and no cost."""

from __future__ import annotations

KERNELS = {"memset": ("k_memset",)}
CASES = ()
OVERWRITE_CASES = ()


def engine_buffers() -> tuple:
    return ()
