"""Artifact manifests: a `<file>.manifest.json` beside every artifact a stage writes.

A manifest records what made the artifact (stage, config subset and its hash, package version,
git commit), from what (sha256 of each input), and what happened (counts, dropped rows by reason,
wall time). Local inputs are stored relative to the artifact's folder, so a results tree that is
moved as a whole still resolves; `lineage` follows them to their own manifests, back to the pull.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from andrea import __version__
from andrea.common.atomic import write_json_atomic
from andrea.common.errors import AndreaError
from andrea.common.hashing import config_hash, sha256_file

MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT = "andrea-manifest/1"


def manifest_path(artifact: str | os.PathLike) -> Path:
    artifact = Path(artifact)
    return artifact.with_name(artifact.name + MANIFEST_SUFFIX)


def git_commit() -> str | None:
    """Commit of the source tree this package runs from; None outside a git checkout."""
    package_dir = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(package_dir), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def local_input(path: str | os.PathLike, artifact: str | os.PathLike) -> dict:
    """A local input file as a manifest records it: path relative to the artifact's folder + sha256."""
    path, artifact = Path(path), Path(artifact)
    relative = os.path.relpath(path.resolve(), artifact.resolve().parent)
    return {"path": Path(relative).as_posix(), "sha256": sha256_file(path)}


def write_manifest(
    artifact: str | os.PathLike,
    *,
    stage: str,
    inputs: Sequence[str | os.PathLike | Mapping],
    config: Mapping,
    counts: Mapping[str, int],
    wall_time_s: float,
    dropped: Mapping[str, int] | None = None,
    dropped_at: Mapping[str, Sequence[str]] | None = None,
    dropped_turns: Mapping[str, int] | None = None,
    dropped_parts: Mapping[str, int] | None = None,
) -> dict:
    """Write `<artifact>.manifest.json` atomically and return it.

    `inputs`: local files as paths (hashed here), or mappings for what is not a local file
    (a Hub dataset, the packaged corpus), stored as given. `dropped` counts rows by reason,
    `dropped_at` the first places (FILE:LINE or FILE:ROW) of each reason; prep adds the turns it
    removed (`dropped_turns`) and both the OpenAI content parts that are not text (`dropped_parts`).
    """
    artifact = Path(artifact)
    manifest = {
        "format": MANIFEST_FORMAT,
        "artifact": artifact.name,
        "stage": stage,
        "sha256": sha256_file(artifact),
        "bytes": artifact.stat().st_size,
        "inputs": [dict(i) if isinstance(i, Mapping) else local_input(i, artifact) for i in inputs],
        "config": dict(config),
        "config_sha256": config_hash(config),
        "andrea_version": __version__,
        "git_commit": git_commit(),
        "counts": dict(counts),
        "dropped": dict(sorted((dropped or {}).items())),
        **{key: {k: (list(v) if key == "dropped_at" else v) for k, v in sorted(value.items())}
           for key, value in (("dropped_at", dropped_at), ("dropped_turns", dropped_turns),
                              ("dropped_parts", dropped_parts)) if value is not None},
        "wall_time_s": round(wall_time_s, 3),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    write_json_atomic(manifest_path(artifact), manifest)
    return manifest


def read_manifest(artifact: str | os.PathLike) -> dict:
    path = manifest_path(artifact)
    if not path.is_file():
        raise AndreaError(f"{artifact}: no manifest at {path}; only files written by an andrea stage have one")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AndreaError(f"{path}: not valid JSON ({err}); rerun the stage that wrote {artifact}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise AndreaError(f"{path}: not an andrea manifest (expected format {MANIFEST_FORMAT!r})")
    return manifest


# -- lineage ------------------------------------------------------------------------------------

@dataclass
class LineageNode:
    """One artifact or raw input in a lineage tree.

    status: ok | modified (bytes differ from the manifest, or from what the consumer recorded)
            | stale (rebuilt since the consumer read it) | missing | external (not a local file)
    """

    label: str
    status: str
    stage: str | None = None
    sha256: str | None = None
    counts: dict = field(default_factory=dict)
    inputs: list["LineageNode"] = field(default_factory=list)
    seen_above: bool = False


def lineage(artifact: str | os.PathLike) -> LineageNode:
    """Walk from an artifact through its inputs' manifests back to the raw pull."""
    artifact = Path(artifact)
    read_manifest(artifact)  # a clear error when the starting point has no manifest
    hashes: dict[Path, str] = {}
    visited: set[Path] = set()

    def current_sha(path: Path) -> str:
        if path not in hashes:
            hashes[path] = sha256_file(path)
        return hashes[path]

    def node(path: Path, label: str, recorded_sha: str | None) -> LineageNode:
        key = path.resolve()
        if not path.is_file():
            return LineageNode(label, "missing", sha256=recorded_sha)
        if not manifest_path(path).is_file():
            status = "ok" if recorded_sha in (None, current_sha(key)) else "modified"
            return LineageNode(label, status, sha256=current_sha(key))
        manifest = read_manifest(path)
        if current_sha(key) != manifest["sha256"]:
            status = "modified"
        elif recorded_sha not in (None, manifest["sha256"]):
            status = "stale"
        else:
            status = "ok"
        result = LineageNode(label, status, manifest["stage"], manifest["sha256"], manifest["counts"])
        if key in visited:
            result.seen_above = True
            return result
        visited.add(key)
        for entry in manifest["inputs"]:
            if "path" in entry:
                child = path.parent / entry["path"]
                result.inputs.append(node(child, os.path.normpath(child), entry.get("sha256")))
            else:
                described = " ".join(f"{k}={v}" for k, v in entry.items() if k != "sha256")
                result.inputs.append(LineageNode(described, "external", sha256=entry.get("sha256")))
        return result

    return node(artifact, str(artifact), None)


def format_lineage(root: LineageNode) -> list[str]:
    """The tree as text lines, one per node, children indented under their consumer."""

    def describe(n: LineageNode) -> str:
        parts = [n.label]
        if n.stage:
            parts.append(f"[{n.stage}]")
        if n.sha256:
            parts.append(f"sha256:{n.sha256[:12]}")
        parts.append(n.status)
        if n.counts and not n.seen_above:
            parts.append(" ".join(f"{k}={v:,}" if isinstance(v, int) else f"{k}={v}" for k, v in n.counts.items()))
        if n.seen_above:
            parts.append("(inputs shown above)")
        return "  ".join(parts)

    lines = [describe(root)]

    def walk(n: LineageNode, prefix: str) -> None:
        for i, child in enumerate(n.inputs):
            last = i == len(n.inputs) - 1
            lines.append(prefix + ("└─ " if last else "├─ ") + describe(child))
            walk(child, prefix + ("   " if last else "│  "))

    walk(root, "")
    return lines


def lineage_ok(root: LineageNode) -> bool:
    return root.status in ("ok", "external") and all(lineage_ok(c) for c in root.inputs)
