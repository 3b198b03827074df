"""Matrix products on the CPU whose bytes do not depend on the thread count.

OpenBLAS splits a product over its threads in a way that changes the rounding: the same product
gives other bytes on 1 and on 2 threads, and a block of rows of a product differs from the same
rows of the whole (its blocking depends on the shape). So the NumPy engine pins the BLAS to one
thread and runs its own threads over fixed blocks of each large product: the blocks depend only
on the shapes, every block is a one-thread BLAS call, and any number of threads gives the same
bytes. See docs/REPRODUCIBILITY.md.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# A product of at least this many multiply-adds is cut into PRODUCT_BLOCKS blocks, along the
# larger of its rows and columns (or along the batch axis of a batched product); smaller ones
# are one call. Both are part of what the bytes depend on: changing them changes trajectories.
SPLIT_MULTIPLY_ADDS = 1 << 22
PRODUCT_BLOCKS = 4

_requested_threads: int | None = None
_pin = None


def requested_threads() -> int:
    """The thread count the process was started with (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS or the
    CPUs it may use), read once, before the engine pins the BLAS to one thread."""
    global _requested_threads
    if _requested_threads is None:
        count = None
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            value = os.environ.get(var, "").strip()
            if value.isascii() and value.isdigit() and int(value) > 0:
                count = int(value)
                break
        _requested_threads = count or len(os.sched_getaffinity(0))
    return _requested_threads


def blas_library() -> list[dict]:
    """The BLAS libraries NumPy loaded, as threadpoolctl reports them (library, version, kernel
    architecture, threading layer, threads)."""
    from threadpoolctl import threadpool_info

    keys = ("internal_api", "version", "architecture", "threading_layer", "num_threads")
    return [{k: info.get(k) for k in keys} for info in threadpool_info() if info.get("user_api") == "blas"]


def pin_blas() -> None:
    """One BLAS thread for the rest of the process (the blocks below are the parallelism)."""
    global _pin
    requested_threads()
    if _pin is None:
        from threadpoolctl import threadpool_limits

        _pin = threadpool_limits(limits=1, user_api="blas")


class BlockedProducts:
    """`matmul(a, b, out)` as fixed blocks on `threads` threads; bytes independent of `threads`."""

    def __init__(self, threads: int | None = None):
        pin_blas()
        self.threads = max(1, threads or requested_threads())
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="andrea-blas") if self.threads > 1 else None
        # read once: the BLAS a process loaded (and its pinned thread count) does not change
        self._description = {
            "numpy": np.__version__,
            "blas": blas_library(),
            "engine_threads": self.threads,
            "products": f"one BLAS thread; products of >= {SPLIT_MULTIPLY_ADDS} multiply-adds in "
                        f"{PRODUCT_BLOCKS} fixed blocks (andrea/engines/cpu_blas.py)",
        }

    def describe(self) -> dict:
        return dict(self._description)

    def matmul(self, a, b, out=None):
        if out is None:
            shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
            out = np.empty(shape, dtype=np.result_type(a, b))
        blocks = self._blocks(a, b, out)
        if len(blocks) == 1 or self._pool is None:
            for block in blocks:
                _run(*block)
        else:
            for done in [self._pool.submit(_run, *block) for block in blocks]:
                done.result()
        return out

    @staticmethod
    def _blocks(a, b, out) -> list[tuple]:
        M, K = a.shape[-2:]
        N = b.shape[-1]
        batch = out.shape[:-2]
        work = int(np.prod(batch, dtype=np.int64)) * M * N * K
        if work < SPLIT_MULTIPLY_ADDS:
            return [(a, b, out)]
        if batch and out.shape[0] > 1:
            # Batched: each item is its own product, so cutting the batch axis cannot change a byte.
            def part(x, lo, hi):  # an operand broadcast along the batch axis goes whole into every block
                return x if x.ndim < out.ndim or x.shape[0] == 1 else x[lo:hi]

            return [(part(a, lo, hi), part(b, lo, hi), out[lo:hi]) for lo, hi in _edges(out.shape[0])]
        if M >= N:
            return [(a[..., lo:hi, :], b, out[..., lo:hi, :]) for lo, hi in _edges(M)]
        return [(a, b[..., lo:hi], out[..., lo:hi]) for lo, hi in _edges(N)]


def _edges(n: int) -> list[tuple[int, int]]:
    cuts = [n * i // PRODUCT_BLOCKS for i in range(PRODUCT_BLOCKS + 1)]
    return [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def _run(a, b, out) -> None:
    np.matmul(a, b, out=out)
