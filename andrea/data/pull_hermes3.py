"""Stage pull-hermes3: raw chat data -> one parquet file in the Hermes-3 schema.

Sources: the Hub (the files of a dataset's train split, streamed at the commit its revision
resolves to), the corpus embedded in this package (the offline default: `embedded` for all its
domains, `embedded:<domain>` for one), or a local JSON, JSONL
(optionally gzip'd) or parquet file in either chat schema. Every record is decoded on its own
(`andrea.data.raw_rows`), so the output holds each kept text exactly as the source does; a record
that cannot be put in the Hermes-3 schema is one drop, counted by reason with the first few line
(or row) numbers in the manifest, and the file is read on. Prep judges the turns.
"""

from __future__ import annotations

import gzip
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pyarrow as pa

from andrea.data import HERMES3_DATASET, embedded_corpus
from andrea.data.conversations import Dropped, hermes_source, hermes_turns
from andrea.data.drops import Drops
from andrea.data.progress import log, progress
from andrea.data.raw_rows import Rows, Unreadable, json_lines, json_records, open_stream, parquet_rows
from andrea.data.tables import BATCH_ROWS, parquet_output
from andrea.common.errors import AndreaError
from andrea.store.manifest import write_manifest

STAGE = "pull-hermes3"
# file name ending -> reader of its (decompressed) bytes
READERS: dict[str, Callable] = {".jsonl": json_lines, ".jsonl.gz": json_lines, ".json": json_records,
                                ".json.gz": json_records, ".parquet": parquet_rows}
ALTERNATIVES = ("pull with `--source embedded` (the corpus shipped in the package) "
                "or `--source PATH` (a local JSON, JSONL or parquet file)")

TURN = pa.struct([("from", pa.string()), ("value", pa.string()), ("weight", pa.float64())])
HERMES_SCHEMA = pa.schema([("conversations", pa.list_(TURN)), ("source", pa.string())])


@dataclass
class RawSource:
    """What a source yields: its files' rows (opened one at a time), how many rows when known,
    and how the manifest names the source."""

    files: Iterable[tuple[str, Callable[[], Rows]]]  # (file label, rows of it)
    total: int | None
    default_source: str
    inputs: list = field(default_factory=list)
    config: dict = field(default_factory=dict)


def reader_for(name: str) -> Callable | None:
    lower = name.lower()
    return next((READERS[end] for end in sorted(READERS, key=len, reverse=True) if lower.endswith(end)), None)


def file_rows(opener: Callable, name: str) -> Callable[[], Rows]:
    """Rows of a file that `opener()` opens in binary mode, read as its name says."""
    reader = reader_for(name)

    def rows() -> Rows:
        with opener() as f:
            yield from (reader(f) if reader is parquet_rows else reader(open_stream(f, name)))

    return rows


def embedded_source(source: str) -> RawSource:
    """`embedded:<domain>`: one domain of the packaged corpus; `embedded`: every domain, in
    DOMAINS order, as one source. Each domain's file is checked against its sha256 before any row
    is read (`embedded_corpus.iter_rows`)."""
    domain = source.partition(":")[2]
    if source != "embedded" and not domain:
        raise AndreaError(f"--source {source}: name a domain, e.g. embedded:{embedded_corpus.DOMAINS[0]}")
    domains = [domain] if domain else list(embedded_corpus.DOMAINS)
    verified = [(d, embedded_corpus.iter_rows(d)) for d in domains]  # all checked before the first row
    infos = [embedded_corpus.info(d) for d in domains]
    files = [(embedded_corpus.corpus_file(d).name, (lambda rows=rows: enumerate(rows, 1))) for d, rows in verified]
    inputs = [{"uri": f"andrea:data/embedded/{meta['file']}", "sha256": meta["sha256"], "license": meta["license"]}
              for meta in infos]
    return RawSource(files, sum(meta["conversations"] for meta in infos), "embedded", inputs=inputs,
                     config={"source": source})


def local_source(path: Path) -> RawSource:
    if path.is_dir():
        raise AndreaError(
            f"{path}: is a directory; --source takes one JSON, JSONL or parquet file in it, or pass "
            f"`--source hub --hub-id {path}` for a folder laid out like a Hub dataset"
        )
    if not path.is_file():
        raise AndreaError(
            f"{path}: no such file; --source takes `hub`, `embedded` or the path of a local JSON, JSONL or parquet file"
        )
    if reader_for(path.name) is None:
        raise AndreaError(f"{path}: unknown file type; use a .json, .jsonl (optionally .gz) or .parquet file")
    total = None
    if path.name.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            total = pq.read_metadata(path).num_rows
        except (pa.ArrowException, OSError) as err:
            raise AndreaError(f"{path}: not a readable parquet file ({err})") from None
    return RawSource([(path.name, file_rows(lambda: open(path, "rb"), path.name))], total, path.name,
                     inputs=[path], config={"source": "path", "format": reader_for(path.name).__name__})


# ---- the Hub ---------------------------------------------------------------------------------

def _quiet_datasets() -> None:
    import datasets

    datasets.logging.set_verbosity_error()
    if not os.isatty(2):  # download bars redraw; in a log file they are noise
        datasets.disable_progress_bars()


def _offline() -> bool:
    import datasets

    return datasets.config.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def resolve_hub_revision(dataset_id: str, revision: str | None) -> str:
    """The commit the Hub serves for `revision`, asked once with a short timeout.

    This fails fast and says why (offline, gated, missing) instead of datasets' retries.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return HfApi().dataset_info(dataset_id, revision=revision, timeout=10).sha
    except GatedRepoError:
        raise AndreaError(
            f"{dataset_id} is gated on the Hugging Face Hub: accept its terms at "
            f"https://huggingface.co/datasets/{dataset_id} and set HF_TOKEN, or {ALTERNATIVES}"
        ) from None
    except RevisionNotFoundError:
        raise AndreaError(
            f"{dataset_id} has no revision {revision!r} on the Hub; check --revision, or {ALTERNATIVES}"
        ) from None
    except RepositoryNotFoundError:
        raise AndreaError(
            f"{dataset_id} was not found on the Hugging Face Hub (a private dataset needs HF_TOKEN); "
            f"check --hub-id, or {ALTERNATIVES}"
        ) from None
    except HfHubHTTPError as err:
        raise AndreaError(f"the Hugging Face Hub refused {dataset_id} ({err}); {ALTERNATIVES}") from None
    except Exception as err:  # network failures surface as several client-library types
        raise AndreaError(
            f"cannot reach the Hugging Face Hub for {dataset_id} ({type(err).__name__}: {err}); "
            f"check the network (or set HF_HUB_OFFLINE=1 to use the local cache), or {ALTERNATIVES}"
        ) from None


def _train_files(dataset_id: str, revision: str | None, offline: bool) -> list[str]:
    """The train split's data files as datasets resolves them (README configs, else its default
    patterns): local paths for a folder, hf:// URLs pinned to the commit otherwise."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(dataset_id, revision=revision)
    except Exception as err:  # datasets wraps network, cache and format failures in many types
        if offline:
            raise AndreaError(
                f"{dataset_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set, so it "
                f"cannot be downloaded; unset HF_HUB_OFFLINE, or {ALTERNATIVES}"
            ) from None
        raise AndreaError(f"datasets could not resolve {dataset_id} ({type(err).__name__}: {err}); {ALTERNATIVES}") from None
    files = list((builder.config.data_files or {}).get("train", []))
    if not files:
        raise AndreaError(f"{dataset_id} has no train split; {ALTERNATIVES}")
    unreadable = [f for f in files if reader_for(f) is None]
    if unreadable:
        raise AndreaError(
            f"{dataset_id}: {unreadable[0]} is neither JSON, JSONL (optionally .gz) nor parquet, which is what "
            f"the pull reads; {ALTERNATIVES}"
        )
    return files


def _hub_opener(url: str, offline: bool) -> Callable:
    """Opens a data file: a local path as it is; a Hub file streamed over HTTP (nothing cached),
    or from the local cache when offline."""
    if not url.startswith("hf://"):
        return lambda: open(url, "rb")
    if offline:
        from datasets.utils.file_utils import cached_path

        return lambda: open(cached_path(url), "rb")
    from huggingface_hub import HfFileSystem

    return lambda: HfFileSystem().open(url, "rb", block_size=8 << 20)


def hub_source(dataset_id: str, revision: str | None) -> RawSource:
    _quiet_datasets()
    offline = _offline()
    # a local clone of a Hub repo needs no network; an offline run reads the local cache
    if not offline and not Path(dataset_id).is_dir():
        revision = resolve_hub_revision(dataset_id, revision)
    log(STAGE, f"reading {dataset_id}" + (f" at {revision}" if revision else ""))
    urls = _train_files(dataset_id, revision, offline)
    names = [u.split("@", 1)[-1].split("/", 1)[-1] if u.startswith("hf://") else os.path.relpath(u, dataset_id)
             for u in urls]
    files = [(name, file_rows(_hub_opener(url, offline), url)) for name, url in zip(names, urls)]
    inputs = [{"dataset": dataset_id, "revision": revision, "files": names}]
    return RawSource(files, None, dataset_id, inputs,
                     {"source": "hub", "dataset": dataset_id, "revision": revision})


# ---- the stage -------------------------------------------------------------------------------

def hermes_rows(raw: RawSource, drops: Drops, parts) -> Iterator[list[dict]]:
    """Batches of Hermes-3 rows from every file of the source; each record that cannot be one is
    counted in `drops` with its place (FILE:LINE, or FILE:ROW for parquet)."""
    batch = []
    for label, rows in raw.files:
        try:
            for number, row in rows():
                if isinstance(row, Unreadable):
                    drops.add(row.reason, f"{label}:{number}")
                    continue
                try:
                    source = hermes_source(row)
                    turns = hermes_turns(row, parts)
                except Dropped as drop:
                    drops.add(drop.reason, f"{label}:{number}")
                    continue
                batch.append({"conversations": turns, "source": source or raw.default_source})
                if len(batch) == BATCH_ROWS:
                    yield batch
                    batch = []
        except (EOFError, zlib.error, gzip.BadGzipFile) as err:
            raise AndreaError(f"{label}: not a complete gzip file ({err}); download it again") from None
        except pa.ArrowException as err:
            raise AndreaError(f"{label}: not a readable parquet file ({err})") from None
    if batch:
        yield batch


def pull_hermes3(source: str, out: str | os.PathLike, revision: str | None = None,
                 hub_id: str = HERMES3_DATASET) -> dict:
    """Run the stage; returns the manifest of `out`."""
    from collections import Counter

    start = time.perf_counter()
    out = Path(out)
    if revision and source != "hub":
        raise AndreaError("--revision applies to `--source hub` only")
    if source == "embedded" or source.startswith("embedded:"):
        raw = embedded_source(source)
    elif source == "hub":
        raw = hub_source(hub_id, revision)
    else:
        raw = local_source(Path(source))
    drops, parts = Drops(), Counter()
    rows_out = 0
    with parquet_output(out, HERMES_SCHEMA) as writer, progress(STAGE, "converting", raw.total, "rows") as advance:
        for batch in hermes_rows(raw, drops, parts):
            writer.write_table(pa.Table.from_pylist(batch, schema=HERMES_SCHEMA))
            rows_out += len(batch)
            advance(len(batch))
        if rows_out == 0:
            raise AndreaError(
                f"{source}: none of its {drops.total:,} records is a conversation in the Hermes-3 "
                f"('conversations': [{{from, value}}]) or OpenAI ('messages': [{{role, content}}]) schema "
                f"(dropped: {drops.summary()}); nothing written"
            )
    manifest = write_manifest(
        out, stage=STAGE, inputs=raw.inputs, config=raw.config,
        counts={"rows_in": rows_out + drops.total, "rows_out": rows_out},
        dropped=drops.counts, dropped_at=drops.where, dropped_parts=parts, wall_time_s=time.perf_counter() - start,
    )
    log(STAGE, f"wrote {out} ({rows_out:,} conversations; dropped {drops.total:,}"
               + (f": {drops.summary()}" if drops.total else "") + ")")
    return manifest
