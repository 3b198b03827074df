"""Stage tokenize: MegaChat train/val -> `train.bin` / `val.bin` token shards and their loss masks
`train.mask.bin` / `val.mask.bin` (see andrea.shards for both formats and the mask convention).

Every conversation is encoded through `andrea.data.chatml` and followed by <|endoftext|>; the mask
is 1 on the tokens of assistant content and the assistant's <|im_end|> (times the turn's weight).
Batches are encoded by up to `--threads` worker processes (encoding holds the GIL; small inputs
stay in this process) and written in input order, so the shards do not depend on the number of
workers. The shards sit beside the tokenizer that made them: training reads DIR/train.bin,
DIR/val.bin and DIR/tokenizer.json from one folder.
"""

from __future__ import annotations

import os
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
from andrea.data.tables import open_parquet
from andrea.data.train_tokenizer import check_vocab_size
from andrea.errors import AndreaError
from andrea.manifest import write_manifest
from andrea.shards import mask_path, mask_writer, shard_writer

STAGE = "tokenize"
TOKENIZER_NAME = "tokenizer.json"
ENCODE_BATCH_ROWS = 1024
# below this much work a worker process costs more to start (about a second of imports) than it saves
ROWS_PER_WORKER = 16 * ENCODE_BATCH_ROWS

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
        for batch in table.iter_batches(batch_size=ENCODE_BATCH_ROWS, columns=["turns"]):
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


def tokenize(tokenizer_path: str | os.PathLike, in_dir: str | os.PathLike, out_dir: str | os.PathLike,
             threads: int = os.cpu_count() or 1) -> dict[str, dict]:
    """Run the stage; returns the manifests of train.bin and val.bin (their masks' manifests sit
    beside the masks)."""
    tokenizer_path, in_dir, out_dir = Path(tokenizer_path), Path(in_dir), Path(out_dir)
    if tokenizer_path.resolve() != (out_dir / TOKENIZER_NAME).resolve():
        raise AndreaError(
            f"--tokenizer {tokenizer_path} must be {out_dir / TOKENIZER_NAME}, so that training finds the shards "
            f"and their tokenizer in one folder; train it with `--out {out_dir / TOKENIZER_NAME}`"
        )
    if threads < 1:
        raise AndreaError(f"--threads {threads} must be at least 1")
    chat = ChatTokenizer.load(tokenizer_path)
    check_vocab_size(chat.vocab_size, f"{tokenizer_path}: vocabulary size")
    parquets = {split: in_dir / f"{split}.parquet" for split in SPLITS}
    tables = {split: open_parquet(path, required=("turns",), made_by="prep-megachat")
              for split, path in parquets.items()}
    rows = sum(table.metadata.num_rows for table in tables.values())
    workers = max(1, min(threads, rows // ROWS_PER_WORKER))
    log(STAGE, f"{rows:,} conversations, {workers} encoder process(es)")
    # spawn, not fork: the parent's tokenizer may already run a thread pool, which fork would break
    pool = (ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_start_worker,
                                initargs=(str(tokenizer_path),)) if workers > 1 else None)
    manifests = {}
    try:
        for split in SPLITS:
            start = time.perf_counter()
            shard = out_dir / f"{split}.bin"
            mask = mask_path(shard)
            with shard_writer(shard) as append, mask_writer(mask) as append_mask:
                counts = tokenize_split(chat, tables[split], parquets[split].name, append, append_mask, pool, workers)
            inputs = [tokenizer_path, parquets[split]]
            manifests[split] = write_manifest(
                shard, stage=STAGE, inputs=inputs, config=SHARD_CONFIG, counts=counts,
                wall_time_s=time.perf_counter() - start,
            )
            write_manifest(mask, stage=STAGE, inputs=inputs, config=MASK_CONFIG, counts=counts,
                           wall_time_s=time.perf_counter() - start)
            log(STAGE, f"wrote {shard} and {mask.name} ({counts['tokens']:,} tokens, "
                       f"{counts['target_tokens']:,} of them assistant targets; {counts['conversations']:,} conversations)")
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    return manifests
