"""Stage pull-hermes3: raw chat data -> one parquet file in the Hermes-3 schema.

Sources: the Hub (`datasets.load_dataset`), the corpus embedded in this package (the offline
default), or a local JSON / JSONL / parquet file in either chat schema. The output keeps the text
as it came (prep cleans it); it only puts each row in the Hermes-3 schema plus a `source` column,
dropping rows that cannot be put in it, counted by reason in the manifest.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa

from andrea.data import HERMES3_DATASET
from andrea.data.conversations import SCHEMAS, Dropped, read_turns, to_hermes
from andrea.data.progress import log, progress
from andrea.data.tables import BATCH_ROWS, parquet_output
from andrea.errors import AndreaError
from andrea.hashing import sha256_file
from andrea.manifest import write_manifest

STAGE = "pull-hermes3"
EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
EMBEDDED_CORPUS = EMBEDDED_DIR / "hermes3-embedded.jsonl.gz"
EMBEDDED_INFO = EMBEDDED_DIR / "hermes3-embedded.json"
LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
ALTERNATIVES = ("pull with `--source embedded` (the corpus shipped in the package) "
                "or `--source PATH` (a local JSON, JSONL or parquet file)")

HERMES_SCHEMA = pa.schema([
    ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
    ("source", pa.string()),
])


@dataclass
class RawRows:
    """What a source yields: row batches, how many rows, and how the manifest names the source."""

    batches: Iterable[list]
    total: int
    default_source: str
    inputs: list = field(default_factory=list)
    config: dict = field(default_factory=dict)


def embedded_rows() -> RawRows:
    info = json.loads(EMBEDDED_INFO.read_text(encoding="utf-8"))
    digest = sha256_file(EMBEDDED_CORPUS)
    if digest != info["sha256"]:
        raise AndreaError(
            f"{EMBEDDED_CORPUS}: sha256 {digest[:12]}… does not match {EMBEDDED_INFO.name} "
            f"({info['sha256'][:12]}…); reinstall andrea or regenerate it with scripts/make_embedded_corpus.py"
        )

    def batches() -> Iterator[list]:
        with gzip.open(EMBEDDED_CORPUS, "rt", encoding="utf-8") as f:
            batch = []
            for line in f:
                batch.append(json.loads(line))
                if len(batch) == BATCH_ROWS:
                    yield batch
                    batch = []
            if batch:
                yield batch

    uri = f"andrea:data/embedded/{EMBEDDED_CORPUS.name}"
    return RawRows(batches(), info["conversations"], "embedded",
                   inputs=[{"uri": uri, "sha256": digest, "license": info["license"]}],
                   config={"source": "embedded"})


def _quiet_datasets() -> None:
    import datasets

    datasets.logging.set_verbosity_error()
    if not os.isatty(2):  # download bars redraw; in a log file they are noise
        datasets.disable_progress_bars()


def _dataset_rows(dataset, default_source: str, inputs: list, config: dict) -> RawRows:
    def batches() -> Iterator[list]:
        for table in dataset.with_format("arrow").iter(batch_size=BATCH_ROWS):
            yield table.to_pylist()

    return RawRows(batches(), len(dataset), default_source, inputs, config)


def _check_schema(dataset, where: str) -> None:
    columns = dataset.column_names
    if not any(column in columns for column, _, _ in SCHEMAS):
        raise AndreaError(
            f"{where}: no 'conversations' (Hermes-3) or 'messages' (OpenAI) column "
            f"(found {', '.join(columns) or 'none'}); convert it to one of the two chat schemas"
        )


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


def hub_rows(dataset_id: str, revision: str | None) -> RawRows:
    import datasets

    _quiet_datasets()
    offline = _offline()
    # a local clone of a Hub repo needs no network; an offline run reads datasets' cache
    if not offline and not Path(dataset_id).is_dir():
        revision = resolve_hub_revision(dataset_id, revision)
    log(STAGE, f"loading {dataset_id}" + (f" at {revision}" if revision else ""))
    try:
        dataset = datasets.load_dataset(dataset_id, split="train", revision=revision)
    except Exception as err:  # datasets wraps network, cache and format failures in many types
        if offline:
            raise AndreaError(
                f"{dataset_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set, so it "
                f"cannot be downloaded; unset HF_HUB_OFFLINE, or {ALTERNATIVES}"
            ) from None
        raise AndreaError(
            f"datasets could not load {dataset_id} ({type(err).__name__}: {err}); {ALTERNATIVES}"
        ) from None
    _check_schema(dataset, dataset_id)
    inputs = [{"dataset": dataset_id, "revision": revision}]
    return _dataset_rows(dataset, dataset_id, inputs, {"source": "hub", "dataset": dataset_id, "revision": revision})


def local_rows(path: Path, cache_dir: str) -> RawRows:
    import datasets

    if not path.is_file():
        raise AndreaError(
            f"{path}: no such file; --source takes `hub`, `embedded` or the path of a local JSON, JSONL or parquet file"
        )
    suffixes = path.suffixes[-2:] if path.suffix == ".gz" else path.suffixes[-1:]
    builder = LOCAL_BUILDERS.get(suffixes[0].lower() if suffixes else "")
    if builder is None:
        raise AndreaError(f"{path}: unknown file type; use a .json, .jsonl (optionally .gz) or .parquet file")
    _quiet_datasets()
    try:
        dataset = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as err:  # datasets reports unreadable files through several exception types
        cause = err.__cause__ or err
        raise AndreaError(
            f"{path}: datasets could not read it as {builder} ({type(cause).__name__}: {cause})"
        ) from None
    _check_schema(dataset, str(path))
    return _dataset_rows(dataset, path.name, [path], {"source": "path", "format": builder})


def hermes_table(rows: list, default_source: str, dropped: Counter) -> pa.Table:
    conversations, sources = [], []
    for row in rows:
        try:
            conversations.append(to_hermes(read_turns(row)))
        except Dropped as drop:
            dropped[drop.reason] += 1
            continue
        source = row.get("source")
        sources.append(source if isinstance(source, str) and source else default_source)
    return pa.table({"conversations": conversations, "source": sources}, schema=HERMES_SCHEMA)


def pull_hermes3(source: str, out: str | os.PathLike, revision: str | None = None,
                 hub_id: str = HERMES3_DATASET) -> dict:
    """Run the stage; returns the manifest of `out`."""
    start = time.perf_counter()
    out = Path(out)
    if revision and source != "hub":
        raise AndreaError("--revision applies to `--source hub` only")
    with tempfile.TemporaryDirectory(prefix="andrea-pull-") as cache_dir:
        if source == "embedded":
            raw = embedded_rows()
        elif source == "hub":
            raw = hub_rows(hub_id, revision)
        else:
            raw = local_rows(Path(source), cache_dir)
        dropped: Counter = Counter()
        rows_in = rows_out = 0
        with parquet_output(out, HERMES_SCHEMA) as writer, progress(STAGE, "converting", raw.total, "rows") as advance:
            for batch in raw.batches:
                table = hermes_table(batch, raw.default_source, dropped)
                writer.write_table(table)
                rows_in += len(batch)
                rows_out += table.num_rows
                advance(len(batch))
            if rows_out == 0:
                raise AndreaError(
                    f"{source}: none of its {rows_in:,} rows is a conversation ({dict(dropped)}); nothing written"
                )
    manifest = write_manifest(
        out, stage=STAGE, inputs=raw.inputs, config=raw.config,
        counts={"rows_in": rows_in, "rows_out": rows_out}, dropped=dropped,
        wall_time_s=time.perf_counter() - start,
    )
    log(STAGE, f"wrote {out} ({rows_out:,} conversations; dropped {sum(dropped.values()):,})")
    return manifest
