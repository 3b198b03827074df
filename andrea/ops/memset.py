"""memset: the kernel that stands for a recorded graph's small memset nodes (kernels/memset.cu; the rewrite is
andrea/engines/graphs.py). No op pair: nothing of the model calls it, so it has no case and no cost."""

from __future__ import annotations

KERNELS = {"memset": ("k_memset",)}
CASES = ()
OVERWRITE_CASES = ()


def engine_buffers() -> tuple:
    return ()
