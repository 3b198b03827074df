"""Content hashes: of files, of configs (over one canonical JSON form, whatever the key order), and
of the source code a pipeline stage runs."""

from __future__ import annotations

import ast
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from andrea.common.errors import AndreaError


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


def imported_names(path: Path) -> Iterator[str]:
    """Every dotted name an import in `path` may load, imports inside functions too: `import a.b`
    names a.b; `from a import b` names a and a.b (b may be a submodule). Relative imports are not
    followed (the package has none)."""
    for node in ast.walk(ast.parse(Path(path).read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def module_file(root: Path, name: str) -> Path | None:
    """The source of module `name` under `root` (a package's __init__.py), or None when it is not one."""
    path = Path(root).joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def code_files(root: Path, entries: Iterable[str], package: str = "andrea") -> set[Path]:
    """The files under `root` that `entries` run. A dotted name is a module, taken with every module of
    `package` it imports, followed statically, with the package __init__.py files each import runs;
    a path (with a slash) is a file, or a folder taken whole."""
    root = Path(root)
    files, modules = set(), []
    for entry in entries:
        path = root / entry
        if "/" not in entry:
            if module_file(root, entry) is None:
                raise AndreaError(f"{entry}: no such module under {root}")
            modules.append(entry)
        elif path.is_file():
            files.add(path)
        elif path.is_dir():
            files.update(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        else:
            raise AndreaError(f"{path}: no such file or folder")
    seen = set()
    while modules:
        name = modules.pop()
        path = module_file(root, name)
        if name in seen or path is None:
            continue
        seen.add(name)
        files.add(path)
        for imported in imported_names(path):
            parts = imported.split(".")
            if parts[0] == package:
                # importing a.b.c runs a/__init__.py and a/b/__init__.py too
                modules.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return files


def code_hash(root: Path, entries: Iterable[str]) -> str:
    """sha256 over the paths (relative to `root`) and contents of code_files(root, entries): by content,
    so a checkout that leaves the text alone keeps the hash."""
    root = Path(root)
    digest = hashlib.sha256()
    for path in sorted(code_files(root, entries)):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()
