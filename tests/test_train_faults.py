"""Faults around the training loop: signals while it starts or while it skips steps, another model
shape behind --init-from, a full disk during the loss history's append, errors in NAME.log."""

import errno
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from andrea.store.checkpoint import write_checkpoint
from andrea.cli import main as cli_main
from andrea.engines.numpy_engine import NumpyEngine
from andrea.store.runfiles import read_loss_history
from test_train_loop import history, run, train_cmd

N_PARAMS = 135_808


@pytest.fixture
def experiment(tmp_path, tiny_experiment_raw):
    raw = dict(tiny_experiment_raw, train={"steps": 40})
    raw["intervals"] = {"checkpoint": 1, "sample": 0, "eval": 10, "eval_batches": 1}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


def train_in_process(experiment, data, out, *extra):
    return cli_main(["train", "--experiment", str(experiment), "--data", str(data), "--out", str(out),
                     "--engine", "numpy", *extra])


def catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler installed for `sig` (its SigCgt mask in /proc)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def signalled_while_starting(cmd, sig) -> subprocess.Popen:
    """Start `cmd` and send it `sig` the moment it has a handler for it: while the trainer is still
    importing and building its engine."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not catches(proc.pid, sig):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.001)
    proc.send_signal(sig)
    return proc


def test_sigterm_while_starting_exits_cleanly_with_the_preemption_code(tmp_path, experiment, repetitive_data):
    out = tmp_path / "tiny.ckpt"
    proc = signalled_while_starting(train_cmd(experiment, repetitive_data, out, "--sigterm-exit-code", "75"),
                                    signal.SIGTERM)
    assert proc.wait(timeout=60) == 75, proc.stderr.read()
    assert "SIGTERM while starting: nothing trained" in proc.stderr.read()
    assert not out.exists() and history(out.with_name("tiny.loss.json")) == []
    run(train_cmd(experiment, repetitive_data, out, "--resume", "--max-steps", "3"))
    assert json.loads(out.with_name("tiny.state.json").read_text())["step"] == 3


def test_sigusr1_while_starting_is_a_checkpoint_after_the_first_step(tmp_path, experiment, repetitive_data):
    out = tmp_path / "tiny.ckpt"
    proc = signalled_while_starting(train_cmd(experiment, repetitive_data, out, "--max-steps", "3"), signal.SIGUSR1)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    reasons = [(e["step"], e["reason"]) for e in map(json.loads, open(out.with_name("tiny.loss.json")))
               if e.get("event") == "checkpoint"]
    assert (1, "SIGUSR1") in reasons


def test_sigterm_is_acted_on_while_every_step_is_skipped(tmp_path, experiment, repetitive_data, monkeypatch):
    original = NumpyEngine.embed_bwd
    calls = {"n": 0}

    def embed_bwd(self, dwte, dwpe, dout, tokens, **kw):
        original(self, dwte, dwpe, dout, tokens, **kw)
        dwte[0, 0] = np.nan  # every step non-finite
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(NumpyEngine, "embed_bwd", embed_bwd)
    out = tmp_path / "tiny.ckpt"
    assert train_in_process(experiment, repetitive_data, out, "--on-nonfinite", "skip", "--max-steps", "30") == 0
    state = json.loads(out.with_name("tiny.state.json").read_text())
    micro = json.loads(experiment.read_text())["batch"]["micro_batches"]
    signalled_step = -(-3 // micro)
    assert state["step"] == signalled_step and state["skipped_steps"] == list(range(1, signalled_step + 1))
    assert "SIGTERM: stopped at step" in out.with_name("tiny.log").read_text()


def test_init_from_another_shape_with_the_same_n_params_is_refused(tmp_path, experiment, repetitive_data,
                                                                      tiny_experiment_raw, capsys):
    other = json.loads(json.dumps(tiny_experiment_raw))
    other["model"].update(vocab_size=448, seq_len=128)  # 448*64 + 128*64 == 512*64 + 64*64
    src = tmp_path / "other" / "other.ckpt"
    src.parent.mkdir()
    write_checkpoint(src, 10, *(np.zeros(N_PARAMS, np.float32) for _ in range(3)))
    src.with_name("other.state.json").write_text(json.dumps({"experiment": other}))
    assert train_in_process(experiment, repetitive_data, tmp_path / "new.ckpt", "--init-from", str(src)) == 2
    err = capsys.readouterr().err
    assert '"vocab_size": 448' in err and '"vocab_size": 512' in err and '"seq_len": 128' in err
    assert "--init-from takes a checkpoint of this experiment's model shape" in err
    assert not (tmp_path / "new.ckpt").exists()


def test_a_full_disk_during_the_loss_append_names_the_file_and_the_checkpoint(tmp_path, experiment,
                                                                                  repetitive_data, monkeypatch, capsys):
    ref = tmp_path / "ref" / "tiny.ckpt"
    run(train_cmd(experiment, repetitive_data, ref, "--max-steps", "10"))
    out = tmp_path / "run" / "tiny.ckpt"
    loss_path = out.with_name("tiny.loss.json")
    real_open = open
    appends = {"n": 0}

    class FullDisk:
        """A file that takes half of the 7th step record, then reports a full disk."""

        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            if '"loss"' in text:
                appends["n"] += 1
                if appends["n"] == 7:
                    self.f.write(text[: len(text) // 2])
                    self.f.flush()
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(text)

    def fake_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if str(path) == str(loss_path) and "a" in mode else f

    monkeypatch.setattr("andrea.store.runfiles.open", fake_open, raising=False)
    assert train_in_process(experiment, repetitive_data, out, "--max-steps", "10") == 2
    err = capsys.readouterr().err
    assert str(loss_path) in err and "No space left on device" in err
    assert "the checkpoint of step 6" in err and "--resume" in err and "Traceback" not in err
    assert "error: " in out.with_name("tiny.log").read_text()  # the sentence is in the run's log too
    assert not loss_path.read_bytes().endswith(b"\n")  # the torn line
    monkeypatch.undo()

    assert train_in_process(experiment, repetitive_data, out, "--max-steps", "10", "--resume") == 0
    assert "last line was cut short" in out.with_name("tiny.log").read_text()
    lines = loss_path.read_text().splitlines()
    torn = [line for line in lines if not line.startswith("{") or not line.endswith("}")]
    assert len(torn) == 1  # the resume event did not glue onto it
    with open(loss_path, "a") as f:
        f.write("null\n[1, 2]\n42\n")
    assert history(loss_path) == history(ref.with_name("tiny.loss.json"))
    assert out.read_bytes() == ref.read_bytes()
    assert [r["step"] for r in read_loss_history(loss_path)] == list(range(1, 11))


def test_an_existing_checkpoint_is_refused_before_the_memory_plan(tmp_path, experiment, repetitive_data):
    out = tmp_path / "tiny.ckpt"
    run(train_cmd(experiment, repetitive_data, out, "--max-steps", "2"))
    again = subprocess.run(train_cmd(experiment, repetitive_data, out), capture_output=True, text=True)
    assert again.returncode == 2
    assert "a checkpoint is already there; pass --resume" in again.stderr
    assert "Memory plan" not in again.stderr and "engine:" not in again.stderr
    assert "error: " in out.with_name("tiny.log").read_text().splitlines()[-1]
