"""The workflow through a real single-node SLURM cluster on this machine (scripts/slurm_check.sh).

Installs slurm-wlm and munge from Debian when missing (root), starts the daemons, runs ANDREA-tiny
through profiles/slurm and checks every non-local job went through sbatch. About two minutes;
deselect with `-m "not slurm"`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP = 77  # slurm_check.sh: SLURM cannot be installed or started here

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_workflow_runs_through_slurm():
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm_check.sh")],
        env={**os.environ, "VENV_BIN": str(Path(sys.executable).parent)},
        capture_output=True, text=True, timeout=1500,
    )
    if proc.returncode == SKIP:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "slurm_check: passed" in proc.stdout
