"""Token shards in llm.c's format, and their loss masks — the one place that knows the headers.

    token shard  header: 256 x int32, little-endian: [0] magic 20240520, [1] version 1, [2] token count
                 body:   token count x uint16 tokens (so vocab_size <= 65536)
    loss mask    header: the same, with [0] magic 20240601
                 body:   token count x uint8, one per token of the shard beside it

Documents are separated by the end-of-text token. Mask convention: mask[i] belongs to token i of
the shard, as a target. The loss of the prediction of token i (made at position i - 1, from tokens
0..i-1) is weighted by mask[i]; so a window whose inputs are tokens[s : s+T] and targets
tokens[s+1 : s+T+1] has target weights mask[s+1 : s+T+1]. 1 marks a target that counts (assistant
content and the assistant's <|im_end|>, times the turn's weight), 0 the rest.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from andrea.common.atomic import atomic_write
from andrea.common.errors import AndreaError

MAGIC = 20240520
MASK_MAGIC = 20240601
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
MASK_DTYPE = np.dtype("u1")
MAX_VOCAB = 1 << 16


MAX_TOKENS = (1 << 31) - 1  # the header's count is an int32


def _header(magic: int, count: int) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = magic, VERSION, count
    return header.tobytes()


@contextmanager
def _writer(path, magic: int, dtype: np.dtype, limit: int, what: str):
    count = 0
    with atomic_write(path) as f:
        f.write(_header(magic, 0))

        def append(values) -> None:
            nonlocal count
            values = np.asarray(values)
            if values.size and (values.min() < 0 or values.max() >= limit):
                raise AndreaError(f"{path}: {what} must lie in [0, {limit}) to fit a {dtype.name} file")
            count += values.size
            if count > MAX_TOKENS:
                raise AndreaError(f"{path}: more than {MAX_TOKENS:,} tokens do not fit one shard's header")
            f.write(values.astype(dtype, copy=False).tobytes())

        yield append
        f.seek(0)
        f.write(_header(magic, count))


def shard_writer(path: str | os.PathLike):
    """A context yielding `append(tokens)`; the shard is written part by part (never whole in
    memory), its header's count filled in at the end, and it replaces `path` atomically (see
    andrea.common.atomic)."""
    return _writer(path, MAGIC, TOKEN_DTYPE, MAX_VOCAB, "token ids")


def mask_writer(path: str | os.PathLike):
    """Like shard_writer, for a loss mask: `append(values)` with values 0 or 1."""
    return _writer(path, MASK_MAGIC, MASK_DTYPE, 2, "mask values")


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write a whole token array as one shard, atomically."""
    with shard_writer(path) as append:
        append(tokens)


def _read(path, magic: int, dtype: np.dtype, what: str, made_by: str) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise AndreaError(f"{path}: {what} not found; run `{made_by}` first")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise AndreaError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte {what} header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != magic or header[1] != VERSION:
        raise AndreaError(
            f"{path}: not a {what} (magic {header[0]}, version {header[1]}; expected {magic}, {VERSION})"
        )
    n = int(header[2])
    expected = HEADER_BYTES + n * dtype.itemsize
    if size != expected:
        raise AndreaError(f"{path}: header says {n} tokens ({expected} bytes) but the file has {size} bytes")
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n,))


def _stream(path, magic: int, dtype: np.dtype, what: str, chunk: int):
    count = _read(path, magic, dtype, what, "andrea tokenize").size
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        for start in range(0, count, chunk):
            yield np.frombuffer(f.read(min(chunk, count - start) * dtype.itemsize), dtype=dtype)


def stream_shard(path: str | os.PathLike, chunk: int = 1 << 22):
    """A shard's tokens in pieces of `chunk`, read (not memory-mapped: a copy of a large shard
    then does not fill the process's RSS with its pages)."""
    return _stream(path, MAGIC, TOKEN_DTYPE, "token shard", chunk)


def stream_mask(path: str | os.PathLike, chunk: int = 1 << 22):
    """A loss mask in pieces of `chunk`, read like stream_shard."""
    return _stream(path, MASK_MAGIC, MASK_DTYPE, "loss mask", chunk)


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Memory-map a shard's tokens after checking its header and size."""
    return _read(path, MAGIC, TOKEN_DTYPE, "token shard", "andrea tokenize")


def mask_path(shard: str | os.PathLike) -> Path:
    """The loss mask beside a shard: train.bin -> train.mask.bin."""
    shard = Path(shard)
    return shard.with_name(shard.name.removesuffix(".bin") + ".mask.bin")


def read_mask(path: str | os.PathLike, tokens: int | None = None, chunk: int = 1 << 24) -> np.ndarray:
    """Memory-map a loss mask after checking its header, its size and its values (0 or 1: a loss
    weight, so any other byte would scale a target's loss); with `tokens`, also that it covers a
    shard of that many tokens. The values are read once, in pieces of `chunk`."""
    mask = _read(path, MASK_MAGIC, MASK_DTYPE, "loss mask", "andrea tokenize")
    if tokens is not None and mask.size != tokens:
        raise AndreaError(
            f"{path}: {mask.size:,} mask values for a shard of {tokens:,} tokens; "
            "rerun `andrea tokenize` to write the shard and its mask together"
        )
    for start in range(0, mask.size, chunk):
        piece = mask[start: start + chunk]
        if piece.max() > 1:  # the writer refuses such values: the file changed since
            at = start + int(np.argmax(piece > 1))
            raise AndreaError(
                f"{path}: mask value {int(mask[at])} at token position {at:,} is not 0 or 1; "
                "rerun `andrea tokenize` to write the shard and its mask again"
            )
    return mask
