"""What a run was made from, and the checks that a consumer is handed the same.

A run's `.state.json` records the data it trained on (each shard it read: bytes and sha256) and its
tokenizer (sha256). `andrea train --resume`, `eval`, `sample` and `export-hf` compare what they are
handed with that record and refuse a mismatch in one sentence naming both: a data folder rewritten
since, or another folder, would otherwise give garbage samples or scores of other data with exit 0.
"""

from __future__ import annotations

from pathlib import Path

from andrea.common.errors import AndreaError
from andrea.common.hashing import sha256_file
from andrea.store.manifest import manifest_path, read_manifest


def file_fingerprint(path: Path, compute: bool = True) -> dict:
    """{"bytes", "sha256"} of a data file. The sha256 is its manifest's when the stage that wrote it left one of
    the same size (hashing a large shard again is what the manifest saves), else computed here; with
    `compute` False a file without a manifest gets bytes only."""
    path = Path(path)
    record = {"bytes": path.stat().st_size}
    if manifest_path(path).is_file():
        try:
            manifest = read_manifest(path)
        except AndreaError:
            manifest = {}
        if manifest.get("bytes") == record["bytes"] and manifest.get("sha256"):
            record["sha256"] = manifest["sha256"]
            return record
    if compute:
        record["sha256"] = sha256_file(path)
    return record


def data_fingerprint(data_dir: Path, files, compute: bool = True) -> dict:
    """{path relative to DATA: file_fingerprint} of the files a run reads."""
    data_dir = Path(data_dir)
    return {str(Path(f).relative_to(data_dir)): file_fingerprint(f, compute) for f in files}


def tokenizer_fingerprint(path: Path | None) -> dict | None:
    return None if path is None else {"path": str(path), "sha256": sha256_file(path)}


def _short(record: dict | None) -> str:
    if record is None:
        return "absent"
    sha = record.get("sha256")
    return f"sha256 {sha[:12]}…" if sha else f"{record['bytes']:,} bytes"


def _files(record: dict) -> dict:
    return {k: v for k, v in (record or {}).items() if isinstance(v, dict) and "bytes" in v}


def record_mismatches(recorded: dict, current: dict) -> list[str]:
    """How two data records differ, one phrase per file; [] when they agree. Files compare by sha256 where both
    sides have one (a state written before every file was hashed may have sizes only), else by size."""
    was_files, now_files = _files(recorded), _files(current)
    out = []
    for key in sorted(set(was_files) | set(now_files)):
        was, now = was_files.get(key), now_files.get(key)
        if was is not None and now is not None:
            both = "sha256" in was and "sha256" in now
            if (was["sha256"] == now["sha256"]) if both else (was["bytes"] == now["bytes"]):
                continue
        out.append(f"{key}: trained on {_short(was)}, now {_short(now)}")
    return out


def data_mismatches(recorded: dict, data_dir: Path, keys=None, compute: bool = True) -> list[str]:
    """How the files under `data_dir` differ from a state's data record; `keys` the files to compare (by
    default every file the record names)."""
    data_dir = Path(data_dir)
    keys = sorted(_files(recorded)) if keys is None else keys
    wanted = {k: v for k, v in _files(recorded).items() if k in keys}
    current = {k: file_fingerprint(data_dir / k, compute) for k in keys if (data_dir / k).is_file()}
    return record_mismatches(wanted, current)


def check_tokenizer(ckpt, state: dict | None, path: Path, state_path: Path) -> None:
    """The tokenizer must be the one the run's state records (a state written before tokenizers were recorded
    is checked through its data record instead: a data folder rewritten since has a new tokenizer too)."""
    recorded = (state or {}).get("tokenizer")
    if recorded:
        sha = sha256_file(path)
        if sha != recorded["sha256"]:
            raise AndreaError(
                f"{ckpt}: was trained with the tokenizer of sha256 {recorded['sha256'][:12]}… ({recorded['path']}, per "
                f"{state_path}), but {path} has sha256 {sha[:12]}…; the data folder was rewritten since or is "
                "another one; pass --tokenizer with the tokenizer it was trained with"
            )
        return
    data = (state or {}).get("data") or {}
    if data.get("dir") and Path(path).parent == Path(data["dir"]):
        changed = data_mismatches(data, Path(data["dir"]), compute=False)
        if changed:
            raise AndreaError(
                f"{ckpt}: its data folder {data['dir']} was rewritten since it was trained ({'; '.join(changed[:2])}, "
                f"per {state_path}), so its tokenizer.json may be another too; pass --tokenizer with the tokenizer "
                "it was trained with"
            )
