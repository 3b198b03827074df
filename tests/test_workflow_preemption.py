"""A training job preempted under the workflow (SIGTERM to the trainer) prints one line and resumes in
the same job, ending bit-identical to an uninterrupted run; the terminal shows progress lines and the
data stages' summaries, the rule's log keeps everything. Then an override that makes the constant
phase longer extends the same run (the old checkpoint linked in results/ keeps its bytes), and
train.cpu_max_steps stops it early, which the report says."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time

import pytest
import yaml

from andrea.store.runfiles import read_loss_history
from test_workflow import SNAKEMAKE, copy_workflow, edit_config, job_counts, snakemake

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


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_preempted_training_job_resumes_then_an_override_extends_it(tmp_path):
    (tmp_path / "wf").mkdir()
    workdir = copy_workflow(tmp_path / "wf", experiments=(NAME,))
    tiny = json.loads((workdir / "config/experiments/ANDREA-tiny-TRAIN.json").read_text())
    del tiny["train"], tiny["schedule"]
    tiny.update(name=NAME, phases=[{"name": "main", "length": {"steps": 300},
                                    "lr": {"warmup_steps": 5, "decay": "constant"}}])
    tiny["intervals"].update(checkpoint=50, sample=0)
    (workdir / f"config/experiments/{NAME}-TRAIN.json").write_text(json.dumps(tiny))
    edit_config(workdir, train={"cpu_max_steps": 1000})

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

    # What the terminal shows: one line for the preemption (no failed job, no memory table), the
    # progress lines with their phase, the last line, each data stage's summary.
    preempted = re.findall(rf"^{NAME}: preempted at step (\d+); resuming$", output, re.M)
    assert len(preempted) == 1 and int(preempted[0]) >= 20, output
    for absent in ("CalledProcessError", "Error in rule", "Memory plan", "buffers"):
        assert absent not in output, absent
    progress = re.findall(r"^step (\d+)/300  phase main  loss [\d.]+  .*eta \d+s$", output, re.M)
    assert 10 <= len(progress) <= 60 and progress[-1] == "300", output
    assert re.findall(rf"^{NAME}: done: step 300 of 300$", output, re.M) == [f"{NAME}: done: step 300 of 300"]
    assert re.search(r"^pull-hermes3 embedded:\w+: [\d,]+ conversations kept of [\d,]+, dropped \d+", output, re.M)
    assert re.search(r"^prep-megachat \S+: [\d,]+ train and [\d,]+ val rows of [\d,]+, dropped", output, re.M)
    assert re.search(r"^tokenize \S+: train [\d,]+ tokens \([\d,]+ assistant targets\)", output, re.M)
    # the rule's log has both trainer runs, the first one's lines kept
    log = (workdir / "results/logs/train" / f"{NAME}.log").read_text()
    assert log.count("Memory plan") >= 2 and f"SIGTERM: stopped at step {preempted[0]}" in log
    assert log.index("SIGTERM: stopped") < log.index(f"preempted at step {preempted[0]}") < log.index("resumed ")
    assert "step 300/300  phase main" in log

    # The same experiment, uninterrupted, outside the workflow: the same bytes.
    ref = tmp_path / "ref" / f"{NAME}.ckpt"
    subprocess.run(["andrea", "train", "--experiment", str(workdir / f"config/experiments/{NAME}-TRAIN.json"),
                    "--data", str(next((workdir / "results/data").glob("tokens-V512-*"))), "--out", str(ref), "--engine", "numpy"],
                   check=True, capture_output=True, env={**os.environ, "PATH": f"{SNAKEMAKE.parent}:{os.environ['PATH']}"})
    assert (workdir / "results" / f"{NAME}.ckpt").read_bytes() == ref.read_bytes()
    assert snakemake(workdir, "--dry-run", f"results/{NAME}.ckpt").stdout.count("Nothing to be done") == 1

    # An override that makes the constant phase longer extends the same run; with cpu_max_steps below
    # the new end it stops there, unfinished, and the report says so. A copy of the old result kept by
    # a hard link keeps its bytes: the trainer replaces files by rename.
    kept = tmp_path / "kept.ckpt"
    os.link(workdir / "results" / f"{NAME}.ckpt", kept)
    before = sha256(kept)
    config = yaml.safe_load((workdir / "config/config.yaml").read_text())
    config["overrides"] = {NAME: ["phases.main.length.steps=330"]}
    config["train"]["cpu_max_steps"] = 310
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    proc = snakemake(workdir, "results/report/evaluation.html", f"results/report/{NAME}.loss.svg")
    output = proc.stdout + proc.stderr
    assert set(job_counts(output)) == {"train", "eval", "eval_table", "plot_loss"}
    assert [p.name for p in (workdir / "results" / "runs" / NAME).iterdir()] == [run.name], "the same run folder"
    assert sha256(kept) == before and not kept.samefile(workdir / "results" / f"{NAME}.ckpt")
    state = json.loads((workdir / "results" / f"{NAME}.state.json").read_text())
    assert (state["step"], state["total_steps"], state["unfinished"]) == (310, 330, "cpu-max-steps")
    assert state["overrides"] == ["phases.main.length.steps=330"]
    history = read_loss_history(workdir / "results" / f"{NAME}.loss.json")
    assert [r["step"] for r in history] == list(range(1, 311))
    assert re.search(rf"^{NAME}: done: step 310 of 330; unfinished", output, re.M), output
    note = "step 310 of 330: the first steps only (no GPU); rerun on a GPU to finish"
    assert note in (workdir / "results/report" / f"{NAME}.loss.svg").read_text()
    assert note in (workdir / "results/report/evaluation.html").read_text()
