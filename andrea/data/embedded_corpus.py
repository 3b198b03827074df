"""The chat corpus shipped in the package: one Hermes-3 JSONL file per domain, read offline.

Each domain is `embedded/<domain>.jsonl.gz` with `embedded/<domain>.json` beside it (counts,
licence, upstream package, and the sha256 the file is checked against before any row is read).
`scripts/make_embedded_corpus.py` writes both; docs/DATA.md describes the domains.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Iterator

from andrea.common.errors import AndreaError

EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
DOMAINS: tuple[str, ...] = ("pydocs", "wordnet")
REPAIR = "reinstall andrea or regenerate it with scripts/make_embedded_corpus.py"


def _known(domain: str) -> str:
    if domain not in DOMAINS:
        raise AndreaError(f"unknown embedded corpus domain {domain!r}; the known domains are {', '.join(DOMAINS)}")
    return domain


def corpus_file(domain: str) -> Path:
    """The domain's gzip JSONL file (not checked: `iter_rows` checks it)."""
    return EMBEDDED_DIR / f"{_known(domain)}.jsonl.gz"


def info(domain: str) -> dict:
    """The domain's info JSON: counts, sha256, licence, upstream package and version, generator."""
    path = EMBEDDED_DIR / f"{_known(domain)}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AndreaError(f"{path} is missing; {REPAIR}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AndreaError(f"{path} is not valid JSON ({e}); {REPAIR}") from None


def iter_rows(domain: str) -> Iterator[dict]:
    """The domain's rows, in file order. The file is checked against its sha256 before this returns,
    so a changed or missing file fails here, before any row is read."""
    expected = info(domain)["sha256"]
    path = corpus_file(domain)
    try:
        compressed = path.read_bytes()
    except FileNotFoundError:
        raise AndreaError(f"{path} is missing; {REPAIR}") from None
    digest = hashlib.sha256(compressed).hexdigest()
    if digest != expected:
        raise AndreaError(f"{path}: sha256 {digest[:12]}… does not match {domain}.json "
                          f"({expected[:12]}…); {REPAIR}")
    # JSON Lines end records at "\n" only (str.splitlines would also cut at U+2028, U+0085, ...)
    return (json.loads(line) for line in gzip.decompress(compressed).decode("utf-8").split("\n") if line)
