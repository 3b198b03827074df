"""Stage prep-megachat: pulled chats -> MegaChat, one clean schema split into train and val.

Each row (Hermes-3 or OpenAI schema, mixed freely) becomes ChatML turns under the turn policy of
`conversations.megachat_turns` (NFC, normalised whitespace; turns training cannot use removed and
counted; rows with nothing left to learn from dropped and counted); repeats of a conversation are
dropped by content hash; the hash also picks the split, so a conversation lands in the same split
whatever else the input holds.

Output columns: id (content hash prefix), source, n_turns, text (ChatML), turns (the structured
turns, with each turn's loss weight, that tokenize encodes, so no one parses ChatML text back).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import pyarrow as pa

from andrea.data.chatml import render
from andrea.data.conversations import SCHEMAS, Dropped, content_hash, megachat_turns
from andrea.data.drops import Drops
from andrea.data.progress import log, progress
from andrea.data.tables import BATCH_ROWS, iter_rows, open_parquet, parquet_output
from andrea.common.errors import AndreaError
from andrea.store.manifest import write_manifest

STAGE = "prep-megachat"
SPLITS = ("train", "val")
ID_HEX_CHARS = 16

MEGACHAT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("n_turns", pa.int32()),
    ("text", pa.string()),
    ("turns", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("weight", pa.uint8())]))),
])


def split_of(digest: str, val_fraction: float) -> str:
    """Last 32 bits of the content hash as a uniform number in [0, 1): below val_fraction is val."""
    return "val" if int(digest[-8:], 16) < val_fraction * 2**32 else "train"


def megachat_records(rows: Iterable, val_fraction: float, drops: Drops, turn_drops: Counter | None = None,
                     parts: Counter | None = None, default_source: str = "unknown",
                     label: str = "row") -> Iterator[tuple[str, dict]]:
    """(split, record) for every usable, first-seen row; every other row is added to `drops` with
    its place (LABEL:N, N counting rows from 1); removed turns and parts go to the counters."""
    turn_drops = Counter() if turn_drops is None else turn_drops
    parts = Counter() if parts is None else parts
    seen: set[int] = set()  # 64 bits of each content hash: a collision among 10^6 rows is ~1e-8
    for number, row in enumerate(rows, 1):
        try:
            turns = megachat_turns(row, turn_drops, parts)
        except Dropped as drop:
            drops.add(drop.reason, f"{label}:{number}")
            continue
        digest = content_hash(turns)
        key = int(digest[:16], 16)
        if key in seen:
            drops.add("duplicate", f"{label}:{number}")
            continue
        seen.add(key)
        source = row.get("source")
        yield split_of(digest, val_fraction), {
            "id": digest[:ID_HEX_CHARS],
            "source": source if isinstance(source, str) and source else default_source,
            "n_turns": len(turns),
            "text": render(turns),
            "turns": turns,
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
    drops, turn_drops, parts = Drops(), Counter(), Counter()
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
        records = megachat_records(rows(), val_fraction, drops, turn_drops, parts,
                                   default_source=in_path.name, label=in_path.name)
        for split, record in records:
            kept[split] += 1
            pending[split].append(record)
            if len(pending[split]) == BATCH_ROWS:
                writers[split].write_table(pa.Table.from_pylist(pending[split], schema=MEGACHAT_SCHEMA))
                pending[split] = []
        for split in SPLITS:
            writers[split].write_table(pa.Table.from_pylist(pending[split], schema=MEGACHAT_SCHEMA))
        if kept["train"] == 0:
            raise AndreaError(
                f"{in_path}: no usable conversation for train.parquet (dropped: {drops.summary()}); nothing written"
            )

    counts = {"rows_in": rows_in, "train_rows": kept["train"], "val_rows": kept["val"],
              "dropped_rows": drops.total, "dropped_turns": sum(turn_drops.values())}
    config = {"val_fraction": val_fraction}
    manifests = {
        split: write_manifest(paths[split], stage=STAGE, inputs=[in_path], config=config, counts=counts,
                              dropped=drops.counts, dropped_at=drops.where, dropped_turns=turn_drops,
                              dropped_parts=parts, wall_time_s=time.perf_counter() - start)
        for split in SPLITS
    }
    log(STAGE, f"wrote {paths['train']} ({kept['train']:,} rows) and {paths['val']} ({kept['val']:,} rows); "
               f"dropped {counts['dropped_rows']:,} rows: {drops.summary()}; "
               f"removed {counts['dropped_turns']:,} turns: {dict(sorted(turn_drops.items())) or 'none'}")
    return manifests
