"""Atomic file replacement: every artifact, checkpoint and manifest is written through here.

A temp file in the target's folder is written, fsynced and renamed over the target, then the
folder is fsynced: a crash, signal or full disk at any moment leaves the old file or the new one,
never a torn one. A failed write removes its temp file and re-raises.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temp path to write (by any library); on success it replaces `path` durably."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb"):
    """Yield an open file; on success it replaces `path` durably."""
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Strict JSON (no NaN or Infinity, which JSON does not have), serialised before the file is touched."""
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"
    with atomic_write(path, "w") as f:
        f.write(text)
