"""Stage tokenize: MegaChat train/val -> `train.bin` / `val.bin` token shards and their loss masks
`train.mask.bin` / `val.mask.bin` (see andrea.store.shards for both formats and the mask convention).

Every conversation is encoded through `andrea.data.chatml` and followed by <|endoftext|>; the mask
is 1 on the tokens of assistant content and the assistant's <|im_end|> (times the turn's weight).
Batches are encoded by up to `--threads` worker processes (encoding holds the GIL; small inputs
stay in this process) and written in input order, so the shards do not depend on the number of
workers. The shards sit beside the tokenizer that made them: one source's in DIR, or each of
several sources' in DIR/<name>/ with their union in DIR (training reads the sources, see
andrea.store.loader, and DIR/tokenizer.json).
"""

from __future__ import annotations

import os
import re
import time
from array import array
from collections import deque
from concurrent.futures import Executor, ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from andrea.data.chatml import ChatTokenizer
from andrea.data.prep_megachat import SPLITS
from andrea.data.progress import log, progress
from andrea.data.tables import iter_batches, open_parquet
from andrea.data.train_tokenizer import check_vocab_size
from andrea.common.errors import AndreaError
from andrea.store.manifest import write_manifest
from andrea.store.shards import mask_path, mask_writer, shard_writer, stream_mask, stream_shard

STAGE = "tokenize"
TOKENIZER_NAME = "tokenizer.json"
ENCODE_BATCH_ROWS = 1024
# below this much work a worker process costs more to start (about a second of imports) than it saves
ROWS_PER_WORKER = 16 * ENCODE_BATCH_ROWS
SOURCE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")

SHARD_CONFIG = {"document_separator": "<|endoftext|>", "format": "llm.c shard v1, uint16"}
MASK_CONFIG = {"format": "andrea loss mask v1, uint8 per token", "targets": "assistant content and <|im_end|>",
               "weights": "per-turn weight", "convention": "mask[i] weights the prediction of token i"}

_worker_chat: ChatTokenizer | None = None


def _start_worker(tokenizer_path: str) -> None:
    global _worker_chat
    os.environ["RAYON_NUM_THREADS"] = "1"  # parallelism comes from the processes
    _worker_chat = ChatTokenizer.load(tokenizer_path)


def encode_batch(batch: pa.RecordBatch, chat: ChatTokenizer | None = None) -> tuple[int, bytes, bytes]:
    """(rows, uint16 tokens, uint8 mask) of a batch of MegaChat rows, each conversation followed by
    <|endoftext|>."""
    chat = chat or _worker_chat
    ids, mask = chat.encode_documents_masked(batch.column("turns").to_pylist())
    return batch.num_rows, array("H", ids).tobytes(), bytes(mask)


def _in_order(pool: Executor, batches: Iterable[pa.RecordBatch], window: int) -> Iterator[tuple[int, bytes, bytes]]:
    """pool.map with at most `window` batches in flight (map would read the whole file first)."""
    pending: deque = deque()
    for batch in batches:
        pending.append(pool.submit(encode_batch, batch))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def tokenize_split(chat: ChatTokenizer, table: pq.ParquetFile, name: str, append, append_mask,
                   pool: Executor | None, workers: int) -> dict:
    """Encode all conversations of one split in order, passing each batch's tokens to `append`
    (a shard writer) and its mask to `append_mask`; encoded in `pool` when there is one. Returns
    the split's counts."""
    counts = {"conversations": 0, "content_bytes": 0, "tokens": 0, "target_tokens": 0}

    def batches() -> Iterator[pa.RecordBatch]:
        for batch in iter_batches(table, ["turns"], ENCODE_BATCH_ROWS):
            counts["conversations"] += batch.num_rows
            contents = batch.column("turns").flatten().field("content")
            counts["content_bytes"] += pc.sum(pc.binary_length(contents)).as_py() or 0
            yield batch

    with progress(STAGE, f"encoding {name}", table.metadata.num_rows, "conversations") as advance:
        encoded = _in_order(pool, batches(), 2 * workers) if pool else (encode_batch(b, chat) for b in batches())
        for rows, part, mask_part in encoded:
            tokens = np.frombuffer(part, dtype=np.uint16)
            mask = np.frombuffer(mask_part, dtype=np.uint8)
            append(tokens)
            append_mask(mask)
            counts["tokens"] += int(tokens.size)
            counts["target_tokens"] += int(np.count_nonzero(mask))
            advance(rows)
    return counts


def _write_split(chat, table, parquet: Path, shard: Path, inputs: list, pool, workers: int) -> dict:
    """One split of one source: its shard, its mask and both manifests; returns the shard's manifest."""
    start = time.perf_counter()
    mask = mask_path(shard)
    with shard_writer(shard) as append, mask_writer(mask) as append_mask:
        counts = tokenize_split(chat, table, parquet.name, append, append_mask, pool, workers)
    manifest = write_manifest(shard, stage=STAGE, inputs=inputs, config=SHARD_CONFIG, counts=counts,
                              wall_time_s=time.perf_counter() - start)
    write_manifest(mask, stage=STAGE, inputs=inputs, config=MASK_CONFIG, counts=counts,
                   wall_time_s=time.perf_counter() - start)
    log(STAGE, f"wrote {shard} and {mask.name} ({counts['tokens']:,} tokens, "
               f"{counts['target_tokens']:,} of them assistant targets; {counts['conversations']:,} conversations)")
    return manifest


def _write_union(out_dir: Path, split: str, names: list[str]) -> dict:
    """DIR/<split>.bin and its mask: the sources' shards one after the other, in name order, for
    what reads one shard per split (training and evaluation find the sources themselves; see
    andrea.store.loader). Its manifest names the sources, and its inputs are their shards."""
    start = time.perf_counter()
    shards = [out_dir / name / f"{split}.bin" for name in names]
    union = out_dir / f"{split}.bin"
    counts = {"tokens": 0, "target_tokens": 0, "sources": len(names)}
    with shard_writer(union) as append, mask_writer(mask_path(union)) as append_mask:
        for shard in shards:
            for tokens in stream_shard(shard):
                append(tokens)
                counts["tokens"] += int(tokens.size)
            for mask in stream_mask(mask_path(shard)):
                append_mask(mask)
                counts["target_tokens"] += int(np.count_nonzero(mask))
    config = {**SHARD_CONFIG, "sources": names, "order": "sources in name order"}
    manifest = write_manifest(union, stage=STAGE, inputs=shards, config=config, counts=counts,
                              wall_time_s=time.perf_counter() - start)
    write_manifest(mask_path(union), stage=STAGE, inputs=[mask_path(s) for s in shards],
                   config={**MASK_CONFIG, "sources": names}, counts=counts, wall_time_s=time.perf_counter() - start)
    return manifest


def tokenize(tokenizer_path: str | os.PathLike, in_dir: str | os.PathLike | None, out_dir: str | os.PathLike,
             threads: int = os.cpu_count() or 1, sources: dict[str, str | os.PathLike] | None = None) -> dict[str, dict]:
    """Run the stage; returns the manifests of OUT_DIR/train.bin and OUT_DIR/val.bin (the masks'
    manifests sit beside the masks).

    `in_dir`: one source's MegaChat folder; the shards go to OUT_DIR. `sources` instead: {name:
    MegaChat folder}; each source's shards go to OUT_DIR/<name>/, and OUT_DIR/{train,val}.bin are
    their union."""
    tokenizer_path, out_dir = Path(tokenizer_path), Path(out_dir)
    if (in_dir is None) == (sources is None):
        raise AndreaError("give either --in-dir (one source) or --source NAME=DIR (one or more), not both")
    if tokenizer_path.resolve() != (out_dir / TOKENIZER_NAME).resolve():
        raise AndreaError(
            f"--tokenizer {tokenizer_path} must be {out_dir / TOKENIZER_NAME}, so that training finds the shards "
            f"and their tokenizer in one folder; train it with `--out {out_dir / TOKENIZER_NAME}`"
        )
    if threads < 1:
        raise AndreaError(f"--threads {threads} must be at least 1")
    for name in sources or ():
        if not SOURCE_NAME.fullmatch(name):
            raise AndreaError(f"--source {name}=...: a source name is letters, digits, '.', '_' or '-' "
                              "(not starting with '.' or '-')")
    chat = ChatTokenizer.load(tokenizer_path)
    check_vocab_size(chat.vocab_size, f"{tokenizer_path}: vocabulary size")
    # (shard folder, MegaChat folder) per source
    jobs = [(out_dir, Path(in_dir))] if sources is None else [(out_dir / n, Path(d)) for n, d in sorted(sources.items())]
    tables = {(folder, split): open_parquet(src / f"{split}.parquet", required=("turns",), made_by="prep-megachat")
              for folder, src in jobs for split in SPLITS}
    rows = sum(table.metadata.num_rows for table in tables.values())
    workers = max(1, min(threads, rows // ROWS_PER_WORKER))
    log(STAGE, f"{rows:,} conversations from {len(jobs)} source(s), {workers} encoder process(es)")
    # spawn, not fork: the parent's tokenizer may already run a thread pool, which fork would break
    pool = (ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_start_worker,
                                initargs=(str(tokenizer_path),)) if workers > 1 else None)
    manifests = {}
    try:
        for folder, src in jobs:
            for split in SPLITS:
                parquet = src / f"{split}.parquet"
                manifests[split] = _write_split(chat, tables[folder, split], parquet, folder / f"{split}.bin",
                                                [tokenizer_path, parquet], pool, workers)
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    if sources is not None:
        manifests = {split: _write_union(out_dir, split, sorted(sources)) for split in SPLITS}
    return manifests
