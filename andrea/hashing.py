"""Content hashes: of files, and of configs (over one canonical JSON form, whatever the key order)."""

from __future__ import annotations

import hashlib
import json
import os


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def config_hash(obj) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()
