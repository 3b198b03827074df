"""Every patch kept under dev/ still applies to the tree (`git apply --check` from the repository root): a kernel
variant kept as a patch is only worth keeping while it applies. CPU only."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCHES = sorted((REPO / "dev").rglob("*.patch"))


def test_dev_has_patches():
    assert PATCHES, "no dev/**/*.patch found (the test below would check nothing)"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("patch", PATCHES, ids=[str(p.relative_to(REPO)) for p in PATCHES])
def test_dev_patch_applies(patch: Path):
    rel = patch.relative_to(REPO)
    done = subprocess.run(["git", "apply", "--check", str(rel)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, (
        f"{rel} no longer applies to the tree (git apply --check):\n{done.stderr.strip()}\n"
        f"Refresh it against the current files, or remove it (git history keeps it).")
