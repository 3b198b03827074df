"""The training loop as a user runs it: subprocesses, signals, resume, bit-exact histories."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from andrea.store.runfiles import read_loss_history

STEPS = 120
HISTORY_FIELDS = ("step", "loss", "lr", "grad_norm", "val_loss")


@pytest.fixture
def experiment(tmp_path, tiny_experiment_raw):
    raw = dict(tiny_experiment_raw, train={"steps": STEPS})
    raw["intervals"] = {"checkpoint": 50, "sample": 0, "eval": 20, "eval_batches": 2}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


def train_cmd(experiment, data, out, *extra):
    return [sys.executable, "-m", "andrea.cli", "train", "--experiment", str(experiment), "--data", str(data),
            "--out", str(out), "--engine", "numpy", *extra]


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def history(path):
    return [{k: r.get(k) for k in HISTORY_FIELDS} for r in read_loss_history(path)]


def events(path):
    return [json.loads(line) for line in open(path) if '"event"' in line]


def wait_for(predicate, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    raise AssertionError("timed out")


def last_step(loss_path):
    if not loss_path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in open(loss_path) if '"loss"' in line]
    return max(steps, default=0)


def test_signals_then_resume_is_bit_identical(tmp_path, experiment, repetitive_data):
    ref = tmp_path / "ref" / "tiny.ckpt"
    run(train_cmd(experiment, repetitive_data, ref))
    ref_history = history(ref.with_name("tiny.loss.json"))
    assert [r["step"] for r in ref_history] == list(range(1, STEPS + 1))

    # The model learns: on a repetitive stream the loss falls well below its start.
    assert ref_history[-1]["loss"] < 0.4 * ref_history[0]["loss"]
    assert ref_history[-1]["val_loss"] < 0.4 * ref_history[0]["loss"]

    out = tmp_path / "run" / "tiny.ckpt"
    loss_path = out.with_name("tiny.loss.json")
    proc = subprocess.Popen(train_cmd(experiment, repetitive_data, out), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: last_step(loss_path) >= 15, proc)
    proc.send_signal(signal.SIGUSR1)
    wait_for(lambda: any(e.get("reason") == "SIGUSR1" for e in events(loss_path)), proc)
    usr1_step = next(e["step"] for e in events(loss_path) if e.get("reason") == "SIGUSR1")
    assert proc.poll() is None, "SIGUSR1 must not stop the run"
    wait_for(lambda: last_step(loss_path) >= usr1_step + 20, proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # a second SIGTERM during the write corrupts nothing
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    stopped = json.loads(out.with_name("tiny.state.json").read_text())["step"]
    assert usr1_step < stopped < STEPS
    assert os.path.getsize(out) == 8 + 12 * 135_808

    resumed = run(train_cmd(experiment, repetitive_data, out, "--resume"))
    assert f"resumed {out} at step {stopped}" in resumed.stderr
    assert out.read_bytes() == ref.read_bytes()
    assert history(loss_path) == ref_history
    kinds = [e["event"] for e in events(loss_path)]
    assert kinds[0] == "start" and "resume" in kinds


def test_two_fresh_runs_are_bit_identical(tmp_path, experiment, repetitive_data):
    a, b = tmp_path / "a" / "tiny.ckpt", tmp_path / "b" / "tiny.ckpt"
    for out in (a, b):
        run(train_cmd(experiment, repetitive_data, out, "--max-steps", "30"))
    assert a.read_bytes() == b.read_bytes()
    assert history(a.with_name("tiny.loss.json")) == history(b.with_name("tiny.loss.json"))
    state = json.loads(a.with_name("tiny.state.json").read_text())
    assert state["step"] == 30 and state["experiment"]["name"] == "ANDREA-tiny"


def test_the_log_says_where_the_training_time_went(tmp_path, experiment, repetitive_data):
    """The closing line splits the invocation's training time into the steps and what the intervals add (here evals
    and an interval checkpoint; no samples: sample 0), the parts summing to the whole."""
    out = tmp_path / "tiny.ckpt"
    err = run(train_cmd(experiment, repetitive_data, out, "--max-steps", "55")).stderr
    line = re.search(r"time: ([\d.,]+) s of training, steps ([\d.]+)% of it; s by part: steps ([\d.,]+), "
                     r"evals ([\d.,]+), samples ([\d.,]+), checkpoints ([\d.,]+), the rest ([\d.,]+)$", err, re.M)
    assert line, err
    wall, share, steps, evals, samples, checkpoints, rest = (float(g.replace(",", "")) for g in line.groups())
    assert steps > 0 and samples == 0
    assert abs(steps + evals + samples + checkpoints + rest - wall) <= 0.03  # five parts, each rounded to 0.01 s
    assert abs(share - 100 * steps / wall) <= 100 * 0.01 / (wall - 0.005) + 0.05  # both read to 0.01 s, share to 0.1%
    assert f"time: {line.group(1)}" in out.with_name("tiny.log").read_text()


def test_time_spent_counts_each_part_and_the_rest(monkeypatch):
    """Each part gets the clock's time inside its blocks (a block that raised too); the rest is what no part had."""
    from andrea.run import train

    clock = iter([0.0, 2.0, 2.0, 2.5, 3.0, 4.25])
    monkeypatch.setattr(train.time, "perf_counter", lambda: next(clock))
    spent = train.TimeSpent()
    with spent.on("steps"):
        pass
    with spent.on("evals"):
        pass
    with pytest.raises(ValueError), spent.on("steps"):
        raise ValueError
    assert spent.seconds == {"steps": 3.25, "evals": 0.5, "samples": 0.0, "checkpoints": 0.0}
    assert spent.line(5.0) == ("time: 5.00 s of training, steps 65.0% of it; s by part: steps 3.25, evals 0.50, "
                               "samples 0.00, checkpoints 0.00, the rest 1.25")


def test_max_steps_then_resume_equals_one_run(tmp_path, experiment, repetitive_data):
    ref, out = tmp_path / "ref" / "tiny.ckpt", tmp_path / "out" / "tiny.ckpt"
    run(train_cmd(experiment, repetitive_data, ref, "--max-steps", "45"))
    run(train_cmd(experiment, repetitive_data, out, "--max-steps", "25"))
    run(train_cmd(experiment, repetitive_data, out, "--max-steps", "45", "--resume"))
    assert out.read_bytes() == ref.read_bytes()
    assert history(out.with_name("tiny.loss.json")) == history(ref.with_name("tiny.loss.json"))


def test_refuses_to_overwrite_or_resume_a_changed_experiment(tmp_path, experiment, repetitive_data):
    out = tmp_path / "tiny.ckpt"
    run(train_cmd(experiment, repetitive_data, out, "--max-steps", "3"))
    again = subprocess.run(train_cmd(experiment, repetitive_data, out), capture_output=True, text=True)
    assert again.returncode == 2
    assert "a checkpoint is already there; pass --resume" in again.stderr
    assert "Traceback" not in again.stderr

    changed = json.loads(experiment.read_text())
    changed["optimizer"]["lr"] = 0.01
    other = tmp_path / "changed.json"
    other.write_text(json.dumps(changed))
    refused = subprocess.run(train_cmd(other, repetitive_data, out, "--resume"), capture_output=True, text=True)
    assert refused.returncode == 2
    assert "experiment changed" in refused.stderr and "optimizer" in refused.stderr

    init = run(train_cmd(other, repetitive_data, tmp_path / "new.ckpt", "--init-from", str(out), "--max-steps", "5"))
    assert "done: step 5" in init.stderr


def test_init_from_a_checkpoint_without_state(tmp_path, experiment, repetitive_data):
    src = tmp_path / "src.ckpt"
    run(train_cmd(experiment, repetitive_data, src, "--max-steps", "4"))
    lone = tmp_path / "lone" / "weights.ckpt"
    lone.parent.mkdir()
    lone.write_bytes(src.read_bytes())
    run(train_cmd(experiment, repetitive_data, tmp_path / "next.ckpt", "--init-from", str(lone), "--max-steps", "6"))
    assert json.loads((tmp_path / "next.state.json").read_text())["step"] == 6


def test_bad_inputs_give_one_sentence(tmp_path, experiment, repetitive_data):
    cases = [
        (train_cmd(experiment, tmp_path / "nowhere", tmp_path / "x.ckpt"), "token shard not found"),
        (train_cmd(tmp_path / "none.json", repetitive_data, tmp_path / "x.ckpt"), "experiment file not found"),
    ]
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"\0" * 100)
    cases.append((train_cmd(experiment, repetitive_data, tmp_path / "y.ckpt", "--init-from", str(bad)), "not a checkpoint"))
    for cmd, message in cases:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr
        assert "Traceback" not in proc.stderr
