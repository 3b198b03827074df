"""Stage train-tokenizer: MegaChat train split -> byte-level BPE `tokenizer.json`.

Trained on exactly the pieces tokenize encodes ("{role}\\n{content}" per turn), split into words
by `chatml.pre_tokenizer`, with the ChatML special tokens at ids 0, 1, 2 and all 256 bytes in the
base alphabet, so any text encodes. No normalizer: decoding gives back the bytes encoded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

from andrea.atomic import atomic_path
from andrea.data.chatml import SPECIAL_TOKENS, pre_tokenizer
from andrea.data.progress import log, progress
from andrea.data.tables import iter_rows, open_parquet
from andrea.errors import AndreaError
from andrea.manifest import write_manifest
from andrea.shards import MAX_VOCAB

STAGE = "train-tokenizer"
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


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


def train_tokenizer(in_path: str | os.PathLike, vocab_size: int, out: str | os.PathLike,
                    min_frequency: int = 2) -> dict:
    """Run the stage; returns the manifest of `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    start = time.perf_counter()
    in_path, out = Path(in_path), Path(out)
    check_vocab_size(vocab_size, "--vocab-size")
    table = open_parquet(in_path, required=("turns",), made_by="prep-megachat")
    n_rows = table.metadata.num_rows
    counts = {"rows": 0, "turns": 0, "content_bytes": 0}

    def pieces() -> Iterator[str]:
        with progress(STAGE, "reading text", n_rows, "conversations") as advance:
            for batch in iter_rows(table, ["turns"]):
                for row in batch:
                    for turn in row["turns"]:
                        counts["turns"] += 1
                        counts["content_bytes"] += len(turn["content"].encode())
                        yield f"{turn['role']}\n{turn['content']}"
                counts["rows"] += len(batch)
                advance(len(batch))
        log(STAGE, f"learning merges up to {vocab_size:,} tokens")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
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
        out, stage=STAGE, inputs=[in_path],
        config={"vocab_size": vocab_size, "min_frequency": min_frequency, "model": "byte-level BPE",
                "special_tokens": list(SPECIAL_TOKENS)},
        counts={**counts, "vocab_size": actual}, wall_time_s=time.perf_counter() - start,
    )
    log(STAGE, f"wrote {out} ({actual:,} tokens, trained on {counts['content_bytes'] / 1e6:.1f} MB of text)")
    return manifest
