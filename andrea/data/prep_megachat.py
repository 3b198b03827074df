"""Stage prep-megachat: pulled chats -> MegaChat, one clean schema split into train and val.

Each row (Hermes-3 or OpenAI schema, mixed freely) becomes ChatML turns with NFC, normalised
whitespace; rows training cannot use are dropped and counted by reason; repeats of a
conversation are dropped by content hash; the hash also picks the split, so a conversation
lands in the same split whatever else the input holds.

Output columns: id (content hash prefix), source, n_turns, text (ChatML), turns (the structured
turns tokenize encodes, so no one parses ChatML text back).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import pyarrow as pa

from andrea.data.chatml import render
from andrea.data.conversations import SCHEMAS, Dropped, content_hash, normalise_turns, read_turns
from andrea.data.progress import log, progress
from andrea.data.tables import BATCH_ROWS, iter_rows, open_parquet, parquet_output
from andrea.errors import AndreaError
from andrea.manifest import write_manifest

STAGE = "prep-megachat"
SPLITS = ("train", "val")
ID_HEX_CHARS = 16

MEGACHAT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("n_turns", pa.int32()),
    ("text", pa.string()),
    ("turns", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
])


def split_of(digest: str, val_fraction: float) -> str:
    """Last 32 bits of the content hash as a uniform number in [0, 1): below val_fraction is val."""
    return "val" if int(digest[-8:], 16) < val_fraction * 2**32 else "train"


def megachat_records(rows: Iterable, val_fraction: float, dropped: Counter,
                     default_source: str = "unknown") -> Iterator[tuple[str, dict]]:
    """(split, record) for every usable, first-seen row; every other row adds one to `dropped`."""
    seen: set[str] = set()
    for row in rows:
        try:
            turns = normalise_turns(read_turns(row))
        except Dropped as drop:
            dropped[drop.reason] += 1
            continue
        digest = content_hash(turns)
        if digest in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(digest)
        source = row.get("source")
        structured = [{"role": role, "content": content} for role, content in turns]
        yield split_of(digest, val_fraction), {
            "id": digest[:ID_HEX_CHARS],
            "source": source if isinstance(source, str) and source else default_source,
            "n_turns": len(turns),
            "text": render(structured),
            "turns": structured,
        }


def prep_megachat(in_path: str | os.PathLike, out_dir: str | os.PathLike,
                  val_fraction: float = 0.05) -> dict[str, dict]:
    """Run the stage; returns the manifests of train.parquet and val.parquet."""
    start = time.perf_counter()
    in_path, out_dir = Path(in_path), Path(out_dir)
    if not 0.0 <= val_fraction < 1.0:
        raise AndreaError(f"--val-fraction {val_fraction} must lie in [0, 1)")
    table = open_parquet(in_path, required=(), made_by="pull-hermes3")
    columns = [c for c in (*(s[0] for s in SCHEMAS), "source") if c in table.schema_arrow.names]
    if not set(columns) - {"source"}:
        raise AndreaError(
            f"{in_path}: no 'conversations' (Hermes-3) or 'messages' (OpenAI) column "
            f"(has {', '.join(table.schema_arrow.names)}); expected the output of `andrea pull-hermes3`"
        )

    paths = {split: out_dir / f"{split}.parquet" for split in SPLITS}
    dropped: Counter = Counter()
    kept = Counter()
    rows_in = 0

    def rows() -> Iterator[Mapping]:
        nonlocal rows_in
        with progress(STAGE, "cleaning", table.metadata.num_rows, "rows") as advance:
            for batch in iter_rows(table, columns):
                yield from batch
                rows_in += len(batch)
                advance(len(batch))

    with parquet_output(paths["train"], MEGACHAT_SCHEMA) as train, parquet_output(paths["val"], MEGACHAT_SCHEMA) as val:
        writers = {"train": train, "val": val}
        pending: dict[str, list] = {split: [] for split in SPLITS}
        for split, record in megachat_records(rows(), val_fraction, dropped, default_source=in_path.name):
            kept[split] += 1
            pending[split].append(record)
            if len(pending[split]) == BATCH_ROWS:
                writers[split].write_table(pa.Table.from_pylist(pending[split], schema=MEGACHAT_SCHEMA))
                pending[split] = []
        for split in SPLITS:
            writers[split].write_table(pa.Table.from_pylist(pending[split], schema=MEGACHAT_SCHEMA))
        if kept["train"] == 0:
            raise AndreaError(
                f"{in_path}: no usable conversation for train.parquet (dropped: {dict(dropped)}); nothing written"
            )

    counts = {"rows_in": rows_in, "train_rows": kept["train"], "val_rows": kept["val"],
              "dropped_rows": sum(dropped.values())}
    config = {"val_fraction": val_fraction}
    manifests = {
        split: write_manifest(paths[split], stage=STAGE, inputs=[in_path], config=config, counts=counts,
                              dropped=dropped, wall_time_s=time.perf_counter() - start)
        for split in SPLITS
    }
    log(STAGE, f"wrote {paths['train']} ({kept['train']:,} rows) and {paths['val']} ({kept['val']:,} rows); "
               f"dropped {counts['dropped_rows']:,}: {dict(sorted(dropped.items())) or 'none'}")
    return manifests
