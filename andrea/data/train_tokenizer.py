"""Stage train-tokenizer: MegaChat train split -> byte-level BPE `tokenizer.json`.

Trained on exactly the pieces tokenize encodes ("{role}\\n" and the content of each turn) of one or more
train splits (several sources: their union, in the order given), split into words by
`chatml.pre_tokenizer`, with the ChatML special tokens at ids 0, 1, 2 and all 256 bytes in the
base alphabet, so any text encodes. No normalizer: decoding gives back the bytes encoded.

Bounds: no token is longer than `max_token_length` characters (of the byte-level alphabet, i.e.
bytes: a run of 200,000 'A's gives tokens of at most that length), and scripts written without
spaces split into words of `unspaced_chunk` characters, so memory follows the number of distinct
words, not the length of a paragraph. Training runs on `threads` threads (tokenizers' pool).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import pyarrow.compute as pc

from andrea.common.atomic import atomic_path
from andrea.data.chatml import (MAX_TOKEN_LENGTH, MAX_UNSPACED_CHUNK, MAX_WORD_CHARS, SPECIAL_TOKENS, UNSPACED_CHUNK,
                                pre_tokenizer)
from andrea.data.progress import log, progress
from andrea.data.tables import iter_batches, open_parquet
from andrea.common.errors import AndreaError
from andrea.store.manifest import write_manifest
from andrea.store.shards import MAX_VOCAB

STAGE = "train-tokenizer"
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
# tokenizers buffers 256 items of the iterator ahead: items of 64 pieces keep that buffer small
# (whole record batches made memory grow with the corpus)
PIECES_PER_ITEM = 64


def check_vocab_size(vocab_size: int, what: str) -> None:
    if vocab_size > MAX_VOCAB:
        raise AndreaError(
            f"{what} {vocab_size:,} exceeds {MAX_VOCAB:,}, the most that uint16 token shards can hold; "
            f"use a vocabulary of at most {MAX_VOCAB:,}"
        )
    if vocab_size < MIN_VOCAB:
        raise AndreaError(
            f"{what} {vocab_size:,} is below {MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )


def train_tokenizer(in_paths, vocab_size: int, out: str | os.PathLike, min_frequency: int = 2,
                    max_token_length: int = MAX_TOKEN_LENGTH, unspaced_chunk: int = UNSPACED_CHUNK,
                    threads: int | None = None) -> dict:
    """Run the stage on one train parquet or a list of them; returns the manifest of `out`."""
    if threads is not None:
        if threads < 1:
            raise AndreaError(f"--threads {threads} must be at least 1")
        # read when tokenizers first starts its pool, i.e. by the training below in a fresh process
        os.environ["RAYON_NUM_THREADS"] = str(threads)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    start = time.perf_counter()
    in_paths = [Path(p) for p in (in_paths if isinstance(in_paths, (list, tuple)) else [in_paths])]
    out = Path(out)
    check_vocab_size(vocab_size, "--vocab-size")
    if not 1 <= max_token_length <= MAX_WORD_CHARS:
        raise AndreaError(f"--max-token-length {max_token_length} must lie in [1, {MAX_WORD_CHARS}] "
                          f"(the longest word the pre-tokenizer makes)")
    if not 1 <= unspaced_chunk <= MAX_UNSPACED_CHUNK:
        raise AndreaError(f"--unspaced-chunk {unspaced_chunk} must lie in [1, {MAX_UNSPACED_CHUNK}]")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer(unspaced_chunk)
    tokenizer.decoder = decoders.ByteLevel()
    tables = [open_parquet(p, required=("turns",), made_by="prep-megachat") for p in in_paths]
    n_rows = sum(t.metadata.num_rows for t in tables)
    counts = {"rows": 0, "turns": 0, "content_bytes": 0}

    def pieces() -> Iterator[list[str]]:
        """Lists of pieces: "{role}\\n" and the content of each turn, apart, as tokenize splits
        them, read column-wise (a Python loop per turn bounded the rate)."""
        with progress(STAGE, "reading text", n_rows, "conversations") as advance:
            for table in tables:
                for batch in iter_batches(table, ["turns"]):
                    turns = batch.column("turns").flatten()
                    contents = turns.field("content")
                    counts["turns"] += len(turns)
                    counts["content_bytes"] += pc.sum(pc.binary_length(contents)).as_py() or 0
                    headers = pc.binary_join_element_wise(turns.field("role"), "\n", "").to_pylist()
                    batch_pieces = [None] * (2 * len(headers))
                    batch_pieces[::2], batch_pieces[1::2] = headers, contents.to_pylist()
                    for start in range(0, len(batch_pieces), PIECES_PER_ITEM):
                        yield batch_pieces[start:start + PIECES_PER_ITEM]
                    counts["rows"] += batch.num_rows
                    advance(batch.num_rows)
        log(STAGE, f"learning merges up to {vocab_size:,} tokens")

    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        max_token_length=max_token_length,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its bar writes to stdout and redraws in logs
    )
    tokenizer.train_from_iterator(pieces(), trainer)
    actual = tokenizer.get_vocab_size(with_added_tokens=True)
    if actual < vocab_size:
        log(STAGE, f"the text supports only {actual:,} tokens of the {vocab_size:,} asked for (no pair left to merge)")
    with atomic_path(out) as tmp:
        tokenizer.save(str(tmp))
    manifest = write_manifest(
        out, stage=STAGE, inputs=in_paths,
        config={"vocab_size": vocab_size, "min_frequency": min_frequency, "max_token_length": max_token_length,
                "unspaced_chunk": unspaced_chunk, "model": "byte-level BPE", "special_tokens": list(SPECIAL_TOKENS)},
        counts={**counts, "vocab_size": actual}, wall_time_s=time.perf_counter() - start,
    )
    log(STAGE, f"wrote {out} ({actual:,} tokens, trained on {counts['content_bytes'] / 1e6:.1f} MB of text)")
    return manifest
