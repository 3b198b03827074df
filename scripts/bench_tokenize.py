"""Tokenization throughput on the embedded corpus, in MB of conversation text per second per core.

    python scripts/bench_tokenize.py [--repeats 3] [--threads N] [--json FILE]

Builds pull -> prep -> train-tokenizer (V=4096) on the embedded corpus in a temp folder, then
times, on the MegaChat train split:
  andrea, 1 core    `tokenize_shards.encode_batch` in this process, word cache cold each repeat
  tokenizers, 1 core  the same pieces through `Tokenizer.encode_batch_fast` (the reference)
  stage, 1 and N    the whole `tokenize` stage (train + val, parquet to shards, worker start-up
                    included) in-process and with N worker processes (forced: on its own the stage
                    keeps a corpus this small in one process); per core = MB / CPU time of the
                    process and its workers, and MB / wall time
MB are UTF-8 bytes of turn content. Single-core rates divide by CPU time, so a busy machine
disturbs them less than wall time; the best of the repeats is reported.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers starts its pool: 1-core reference

import argparse
import contextlib
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq


def cpu_seconds() -> float:
    """CPU time of this process and of its finished worker processes."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def best_of(repeats: int, run) -> float:
    """Smallest CPU time of `repeats` calls of run()."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="workers for the stage run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    from andrea.data import tokenize_shards
    from andrea.data.chatml import ChatTokenizer
    from andrea.data.prep_megachat import prep_megachat
    from andrea.data.pull_hermes3 import pull_hermes3
    from andrea.data.tokenize_shards import encode_batch, tokenize
    from andrea.data.train_tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory(prefix="andrea-bench-") as tmp, open(os.devnull, "w") as quiet, \
            contextlib.redirect_stderr(quiet):
        tmp = Path(tmp)
        tokens_dir = tmp / "tokens-V4096"
        pull_hermes3("embedded", tmp / "hermes3.parquet")
        prep_megachat(tmp / "hermes3.parquet", tmp / "megachat")
        train_tokenizer(tmp / "megachat" / "train.parquet", 4096, tokens_dir / "tokenizer.json")

        table = pq.read_table(tmp / "megachat" / "train.parquet", columns=["turns"])
        batches = table.to_batches(max_chunksize=1024)
        turns = table.column("turns").to_pylist()
        pieces = [piece for conv in turns for t in conv for piece in (f"{t['role']}\n", t["content"])]
        megabytes = sum(len(t["content"].encode()) for conv in turns for t in conv) / 1e6

        def andrea_one_core():
            chat = ChatTokenizer.load(tokens_dir / "tokenizer.json")  # cold word cache
            for batch in batches:
                encode_batch(batch, chat)

        reference = ChatTokenizer.load(tokens_dir / "tokenizer.json").tokenizer
        andrea_cpu = best_of(args.repeats, andrea_one_core)
        reference_cpu = best_of(args.repeats, lambda: reference.encode_batch_fast(pieces, add_special_tokens=False))

        stage = {}  # workers -> (best wall s, best CPU s of this process and its workers)
        tokenize_shards.ROWS_PER_WORKER = 1  # the stage would keep a corpus this small in one process
        for threads in sorted({1, args.threads}):
            walls, cpus = [], []
            for _ in range(args.repeats):
                start, cpu_start = time.perf_counter(), cpu_seconds()
                manifests = tokenize(tokens_dir / "tokenizer.json", tmp / "megachat", tokens_dir, threads=threads)
                walls.append(time.perf_counter() - start)
                cpus.append(cpu_seconds() - cpu_start)
            stage[threads] = (min(walls), min(cpus))
        stage_megabytes = sum(m["counts"]["content_bytes"] for m in manifests.values()) / 1e6

    figures = {
        "corpus_mb": round(megabytes, 3),
        "andrea_mb_per_s_per_core": round(megabytes / andrea_cpu, 2),
        "tokenizers_encode_batch_fast_mb_per_s_per_core": round(megabytes / reference_cpu, 2),
        "stage_mb": round(stage_megabytes, 3),
        "stage_mb_per_s": {n: round(stage_megabytes / wall, 2) for n, (wall, _) in stage.items()},
        "stage_mb_per_s_per_core": {n: round(stage_megabytes / cpu, 2) for n, (_, cpu) in stage.items()},
        "cpu": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    print(f"corpus: {megabytes:.2f} MB of text (MegaChat train split of the embedded corpus)")
    print(f"andrea encode, 1 core:                 {figures['andrea_mb_per_s_per_core']:6.2f} MB/s per core")
    reference_rate = figures["tokenizers_encode_batch_fast_mb_per_s_per_core"]
    print(f"tokenizers encode_batch_fast, 1 core:  {reference_rate:6.2f} MB/s per core")
    for n, (wall, cpu) in stage.items():
        print(f"tokenize stage, {n} worker(s):          {stage_megabytes / cpu:6.2f} MB/s per core, "
              f"{stage_megabytes / wall:.2f} MB/s wall")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
