"""Token shards in llm.c's format — the one place that knows the header.

    header: 256 x int32, little-endian: [0] magic 20240520, [1] version 1, [2] token count
    body:   token count x uint16 tokens (so vocab_size <= 65536)

Documents are separated by the end-of-text token.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from andrea.atomic import atomic_write
from andrea.errors import AndreaError

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
MAX_VOCAB = 1 << 16


MAX_TOKENS = (1 << 31) - 1  # the header's count is an int32


def _header(count: int) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, count
    return header.tobytes()


@contextmanager
def shard_writer(path: str | os.PathLike):
    """Yield `append(tokens)`; the shard is written part by part (never whole in memory), its
    header's count filled in at the end, and it replaces `path` atomically (see andrea.atomic)."""
    count = 0
    with atomic_write(path) as f:
        f.write(_header(0))

        def append(tokens) -> None:
            nonlocal count
            tokens = np.asarray(tokens)
            if tokens.size and (tokens.min() < 0 or tokens.max() >= MAX_VOCAB):
                raise AndreaError(f"{path}: token ids must lie in [0, {MAX_VOCAB}) to fit a uint16 shard")
            count += tokens.size
            if count > MAX_TOKENS:
                raise AndreaError(f"{path}: more than {MAX_TOKENS:,} tokens do not fit one shard's header")
            f.write(tokens.astype(TOKEN_DTYPE, copy=False).tobytes())

        yield append
        f.seek(0)
        f.write(_header(count))


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write a whole token array as one shard, atomically."""
    with shard_writer(path) as append:
        append(tokens)


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Memory-map a shard's tokens after checking its header and size."""
    path = Path(path)
    if not path.is_file():
        raise AndreaError(f"{path}: token shard not found; run `andrea tokenize` first")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise AndreaError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC or header[1] != VERSION:
        raise AndreaError(
            f"{path}: not a token shard (magic {header[0]}, version {header[1]}; "
            f"expected {MAGIC}, {VERSION})"
        )
    n = int(header[2])
    expected = HEADER_BYTES + n * TOKEN_DTYPE.itemsize
    if size != expected:
        raise AndreaError(f"{path}: header says {n} tokens ({expected} bytes) but the file has {size} bytes")
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(n,))
