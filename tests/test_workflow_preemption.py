"""A training job preempted under the workflow (SIGTERM, as SLURM sends) is retried by Snakemake
and resumes from its checkpoint, ending bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from andrea.runfiles import read_loss_history
from test_workflow import SNAKEMAKE, copy_workflow, snakemake

pytestmark = pytest.mark.slow
NAME = "ANDREA-tinylong"


def trainer_pid(workdir) -> int | None:
    """The `andrea train` process of this workflow copy (not Snakemake's shell around it)."""
    out = subprocess.run(["pgrep", "-f", f"andrea train --experiment config/experiments/{NAME}"],
                         capture_output=True, text=True).stdout.split()
    for pid in out:
        if os.readlink(f"/proc/{pid}/cwd") == str(workdir) and "python" in open(f"/proc/{pid}/cmdline").read():
            return int(pid)
    return None


def steps_done(workdir) -> int:
    logs = list((workdir / "results" / "runs" / NAME).glob("*/*.loss.json"))
    return sum(1 for line in open(logs[0]) if '"loss"' in line) if logs else 0


def test_preempted_training_job_is_retried_and_resumes(tmp_path):
    (tmp_path / "wf").mkdir()
    workdir = copy_workflow(tmp_path / "wf", experiments=(NAME,))
    tiny = json.loads((workdir / "config/experiments/ANDREA-tiny-TRAIN.json").read_text())
    tiny.update(name=NAME, train={"steps": 300})
    tiny["intervals"].update(checkpoint=50, sample=0)
    (workdir / f"config/experiments/{NAME}-TRAIN.json").write_text(json.dumps(tiny))

    proc = subprocess.Popen([str(SNAKEMAKE), "--cores", "2", f"results/{NAME}.ckpt"], cwd=workdir,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while steps_done(workdir) < 20:
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.05)
    pid = trainer_pid(workdir)
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output

    run = next((workdir / "results" / "runs" / NAME).iterdir())
    events = [json.loads(line)["event"] for line in open(run / f"{NAME}.loss.json") if '"event"' in line]
    assert "resume" in events
    assert (workdir / "results" / f"{NAME}.ckpt").samefile(run / f"{NAME}.ckpt")
    history = [(r["step"], r["loss"]) for r in read_loss_history(workdir / "results" / f"{NAME}.loss.json")]
    assert [s for s, _ in history] == list(range(1, 301))

    # The same experiment, uninterrupted, outside the workflow: the same bytes.
    ref = tmp_path / "ref" / f"{NAME}.ckpt"
    subprocess.run(["andrea", "train", "--experiment", str(workdir / f"config/experiments/{NAME}-TRAIN.json"),
                    "--data", str(next((workdir / "results/data").glob("tokens-V512-*"))), "--out", str(ref), "--engine", "numpy"],
                   check=True, capture_output=True, env={**os.environ, "PATH": f"{SNAKEMAKE.parent}:{os.environ['PATH']}"})
    assert (workdir / "results" / f"{NAME}.ckpt").read_bytes() == ref.read_bytes()
    assert snakemake(workdir, "--dry-run", f"results/{NAME}.ckpt").stdout.count("Nothing to be done") == 1
