"""Throughput and memory of every data stage on synthetic Hermes-like input of a given size.

    python scripts/bench_data.py --mb 100 [--mb 1000] [--vocab-size 4096] [--threads N] [--json FILE]
                                 [--keep DIR]

For each size: writes a JSONL file of that many MB (Hermes-3 rows: an optional system prompt, one
to four human/gpt exchanges of Zipf-distributed words, some code, some CJK and other non-ASCII
text, per-turn weights on some rows, a broken line and a mixed-type value now and then), then runs
pull-hermes3, prep-megachat, train-tokenizer and tokenize on it as a user would (the `andrea` CLI,
one process per stage, `--threads N` where a stage takes it), and prints per stage: wall time, MB
of its input per second, and peak RSS, both of the largest process (getrusage of the finished
children) and of the stage's whole process tree (its and its workers' RSS summed, sampled from
/proc every 0.5 s). MB/s is the raw input's size (10^6 bytes of JSONL) over the stage's wall time
for every stage, so the stages compare with each other and across sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
SAMPLE_S = 0.5  # a scan of /proc costs CPU the stages need (every 50 ms it took half a core)
# ... except in a stage's first seconds: a stage shorter than SAMPLE_S would go unobserved, and its RSS
# climbs to its peak there (the imports, the first batch)
FIRST_SAMPLE_S, FIRST_SECONDS = 0.02, 2.0
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer briefly.", "You are a careful programmer. Explain your code.",
                  "Réponds en français si possible.", ""]
CODE = ["def f(x):\n    return x * 2\n", "for i in range(10):\n    print(i)\n",
        "import numpy as np\nx = np.zeros((3, 4))\n", "SELECT name FROM users WHERE id = 1;"]


def vocabulary(rng: random.Random, n: int = 60_000) -> tuple[list[str], list[float]]:
    """Pronounceable words with Zipf frequencies, some with accents."""
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "é", "ü")]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(n)})
    rng.shuffle(words)
    cumulative, total = [], 0.0
    for rank in range(len(words)):
        total += 1.0 / (rank + 1)
        cumulative.append(total)
    return words, cumulative


class Generator:
    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.words, self.cumulative = vocabulary(self.rng)
        self.cjk = [chr(0x4E00 + self.rng.randrange(3000)) for _ in range(3000)]

    def sentence(self, n: int) -> str:
        words = self.rng.choices(self.words, cum_weights=self.cumulative, k=n)
        return " ".join(words).capitalize() + self.rng.choice([".", ".", "?", "!"])

    def text(self) -> str:
        rng = self.rng
        kind = rng.random()
        if kind < 0.05:
            return "".join(rng.choice(self.cjk) for _ in range(rng.randint(20, 400))) + "。"
        parts = [self.sentence(rng.randint(4, 25)) for _ in range(rng.randint(1, 8))]
        if kind < 0.2:
            parts.append("```python\n" + rng.choice(CODE) + "```")
        return "\n\n".join(parts) if rng.random() < 0.3 else " ".join(parts)

    def row(self, i: int) -> str:
        rng = self.rng
        turns = []
        if rng.random() < 0.3:
            turns.append({"from": "system", "value": rng.choice(SYSTEM_PROMPTS)})
        weights = rng.random() < 0.2
        for _ in range(rng.randint(1, 4)):
            turns.append({"from": "human", "value": self.text()})
            turns.append({"from": "gpt", "value": self.text()})
            if weights:
                turns[-2]["weight"], turns[-1]["weight"] = 0, 1
        if i % 1000 == 999:
            turns[-1]["value"] = 42  # a mixed type: one counted drop, nothing else changes
        line = json.dumps({"conversations": turns, "source": "synthetic"}, ensure_ascii=False)
        return line[: len(line) // 2] if i % 1500 == 1499 else line  # now and then a broken line


def write_input(path: Path, megabytes: float, seed: int = 0) -> int:
    generator, size, rows = Generator(seed), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            line = generator.row(rows) + "\n"
            f.write(line)
            size += len(line.encode())
            rows += 1
    return rows


def tree_rss(root: int) -> int:
    """RSS in bytes of `root` and all its descendants, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass
        todo.extend(parents.get(pid, []))
    return total


def run_stage(argv: list[str], log: Path) -> dict:
    """Run one stage; its wall time, the largest process's peak RSS and the tree's peak RSS."""
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        peak, done = 0, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(FIRST_SAMPLE_S if time.perf_counter() - start < FIRST_SECONDS else SAMPLE_S):
                peak = max(peak, tree_rss(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        done.set()
        sampler.join()
    if status != 0:
        raise SystemExit(f"{' '.join(argv)} failed (status {status}); see {log}")
    return {"wall_s": round(wall, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "peak_tree_rss_mb": round(peak / 2**20, 1)}


def bench(megabytes: float, root: Path, vocab_size: int, threads: int) -> dict:
    andrea = [sys.executable, "-m", "andrea.cli"]
    raw = root / "chats.jsonl"
    start = time.perf_counter()
    rows = write_input(raw, megabytes)
    print(f"{megabytes:g} MB: wrote {rows:,} rows in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    data, tokens = root / "sources" / "synthetic", root / f"tokens-V{vocab_size}"
    stages = [  # (name, the files it reads, its command line)
        ("pull-hermes3", [raw], ["pull-hermes3", "--source", str(raw), "--out", str(data / "hermes3.parquet")]),
        ("prep-megachat", [data / "hermes3.parquet"],
         ["prep-megachat", "--in", str(data / "hermes3.parquet"), "--out-dir", str(data / "megachat")]),
        ("train-tokenizer", [data / "megachat" / "train.parquet"],
         ["train-tokenizer", "--in", str(data / "megachat" / "train.parquet"), "--vocab-size", str(vocab_size),
          "--threads", str(threads), "--out", str(tokens / "tokenizer.json")]),
        ("tokenize", [data / "megachat" / "train.parquet", data / "megachat" / "val.parquet"],
         ["tokenize", "--tokenizer", str(tokens / "tokenizer.json"), "--source", f"synthetic={data / 'megachat'}",
          "--out-dir", str(tokens), "--threads", str(threads)]),
    ]
    raw_mb = raw.stat().st_size / 1e6
    results = {"input_mb": round(raw_mb, 1), "rows": rows, "stages": {}}
    for name, inputs, argv in stages:
        measured = run_stage(andrea + argv, root / f"{name}.log")
        measured["stage_input_mb"] = round(sum(p.stat().st_size for p in inputs) / 1e6, 1)
        measured["mb_per_s"] = round(raw_mb / measured["wall_s"], 2)
        results["stages"][name] = measured
        print(f"  {name:16s} {measured['wall_s']:7.1f} s = {measured['mb_per_s']:6.2f} MB/s, "
              f"peak RSS {measured['peak_rss_mb']:6.0f} MB (process), {measured['peak_tree_rss_mb']:6.0f} MB (tree)",
              file=sys.stderr)
    manifest = json.loads((tokens / "train.bin.manifest.json").read_text())
    results["train_tokens"] = manifest["counts"]["tokens"]
    results["train_content_mb"] = round(json.loads((tokens / "tokenizer.json.manifest.json").read_text())
                                        ["counts"]["content_bytes"] / 1e6, 1)
    pulled = json.loads((data / "hermes3.parquet.manifest.json").read_text())
    results["pull_dropped"] = pulled["dropped"]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, action="append", help="input size in MB (repeat for several)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temp folder)")
    args = parser.parse_args()
    figures = {"cpu": os.cpu_count(), "threads": args.threads, "vocab_size": args.vocab_size,
               "python": sys.version.split()[0], "runs": []}
    for megabytes in args.mb or [100]:
        with tempfile.TemporaryDirectory(prefix="andrea-bench-data-") as tmp:
            root = args.keep / f"{megabytes:g}MB" if args.keep else Path(tmp)
            root.mkdir(parents=True, exist_ok=True)
            figures["runs"].append(bench(megabytes, root, args.vocab_size, args.threads))
    print(f"{'stage':16s} " + " ".join(f"{r['input_mb']:>8g} MB: MB/s, peak RSS (process / tree)" for r in figures["runs"]))
    for name in figures["runs"][0]["stages"]:
        cells = [f"{s['mb_per_s']:6.2f} MB/s, {s['peak_rss_mb']:5.0f} / {s['peak_tree_rss_mb']:5.0f} MB"
                 for s in (r["stages"][name] for r in figures["runs"])]
        print(f"{name:16s} " + "   ".join(f"{c:>40s}" for c in cells))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
