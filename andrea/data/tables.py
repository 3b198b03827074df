"""Parquet in and out for the data stages: clear errors on read, atomic writes."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from andrea.common.atomic import atomic_path
from andrea.common.errors import AndreaError

BATCH_ROWS = 2048


def open_parquet(path: str | os.PathLike, required: Sequence[str], made_by: str) -> pq.ParquetFile:
    """Open a stage's parquet input; every failure names the file and the stage that makes it."""
    path = Path(path)
    if not path.is_file():
        raise AndreaError(f"{path}: no such file; run `andrea {made_by}` first or check the path")
    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise AndreaError(f"{path}: not a readable parquet file ({err}); rerun `andrea {made_by}`") from None
    missing = [c for c in required if c not in table.schema_arrow.names]
    if missing:
        raise AndreaError(
            f"{path}: missing column(s) {', '.join(missing)} (has {', '.join(table.schema_arrow.names)}); "
            f"expected the output of `andrea {made_by}`"
        )
    return table


def iter_batches(table: pq.ParquetFile, columns: Sequence[str] | None = None,
                 batch_size: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
    """Record batches, one row group after another, each row group with a reader of its own:
    one `ParquetFile.iter_batches` over the whole file holds on to what it has read (its memory grew
    by 2 MB per row group), so memory here stays that of one row group, whatever the file's size."""
    for group in range(table.num_row_groups):
        yield from table.iter_batches(batch_size=batch_size, row_groups=[group],
                                      columns=None if columns is None else list(columns))


def iter_rows(table: pq.ParquetFile, columns: Sequence[str]) -> Iterator[list[dict]]:
    """Rows as dicts, a batch at a time (the whole file need not fit in memory)."""
    for batch in iter_batches(table, columns):
        yield batch.to_pylist()


@contextmanager
def parquet_output(path: str | os.PathLike, schema: pa.Schema) -> Iterator[pq.ParquetWriter]:
    """A ParquetWriter whose file appears at `path` only once it is complete."""
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        yield writer
