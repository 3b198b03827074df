"""Fault injection: signals at random moments, kills during writes, NaN, full disk, I/O errors,
a supervised child killed. Nothing may be lost or corrupted, and every resume is bit-exact."""

import errno
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from andrea.store.checkpoint import read_checkpoint
from andrea.common.hashing import sha256_file
from andrea.cli import main as cli_main
from andrea.engines.numpy_engine import NumpyEngine
from andrea.store.shards import read_shard, write_shard
from test_train_loop import history, run, train_cmd, wait_for

STEPS = 400
N_PARAMS = 135_808


@pytest.fixture(scope="module")
def setup(tmp_path_factory, ):
    """A long tiny experiment (checkpoint every step, so signals often land during writes) and the
    uninterrupted reference run everything is compared with."""
    root = tmp_path_factory.mktemp("reliability")
    raw = json.loads((Path(__file__).parents[1] / "config/experiments/ANDREA-tiny-TRAIN.json").read_text())
    raw["train"] = {"steps": STEPS}
    raw["intervals"] = {"checkpoint": 1, "sample": 0, "eval": 25, "eval_batches": 1}
    experiment = root / "tiny.json"
    experiment.write_text(json.dumps(raw))
    rng = np.random.default_rng(0)
    data = root / "tokens"
    data.mkdir()
    pattern = rng.integers(0, 512, 300)
    write_shard(data / "train.bin", np.tile(pattern, 40))
    write_shard(data / "val.bin", np.tile(pattern, 4))
    ref = root / "ref" / "tiny.ckpt"
    run(train_cmd(experiment, data, ref))
    return experiment, data, ref, history(ref.with_name("tiny.loss.json"))


def steps_logged(loss_path: Path) -> int:
    if not loss_path.exists():
        return 0
    return sum(1 for line in open(loss_path) if '"loss"' in line)


def assert_intact(out: Path):
    """The checkpoint is whole and one that its .state.json vouches for."""
    assert out.stat().st_size == 8 + 12 * N_PARAMS
    recorded = {c["sha256"] for c in json.loads(out.with_name("tiny.state.json").read_text())["checkpoints"]}
    assert sha256_file(out) in recorded
    step, params, m, v = read_checkpoint(out, N_PARAMS)
    assert np.isfinite(params).all()
    return step


@pytest.mark.slow  # ~35-55 s of signals on 2 cores
def test_random_sigterms_and_sigkills_lose_nothing(tmp_path, setup):
    experiment, data, ref, ref_history = setup
    out = tmp_path / "tiny.ckpt"
    loss_path = out.with_name("tiny.loss.json")
    rnd = random.Random(1)
    plan = ["TERM"] * 50 + ["KILL"] * 20
    rnd.shuffle(plan)
    kills_during_write = 0
    last_step = 0
    for kind in plan:
        proc = subprocess.Popen(train_cmd(experiment, data, out, "--resume"), stderr=subprocess.PIPE, text=True)
        seen = steps_logged(loss_path)
        wait_for(lambda: steps_logged(loss_path) > seen, proc)
        if kind == "TERM":
            time.sleep(rnd.uniform(0, 0.08))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, proc.stderr.read()
        else:
            deadline = time.time() + 0.5
            while time.time() < deadline and not list(tmp_path.glob(".tiny.ckpt.tmp*")):
                pass
            kills_during_write += bool(list(tmp_path.glob(".tiny.ckpt.tmp*")))
            proc.kill()
            proc.wait()
        proc.stderr.close()
        step = assert_intact(out)
        assert step >= last_step
        last_step = step
    print(f"\n{kills_during_write} of 20 SIGKILLs landed during a checkpoint write; last step {last_step}")
    assert last_step < STEPS, "the interruptions must all land inside the run"
    assert kills_during_write >= 5
    run(train_cmd(experiment, data, out, "--resume"))
    assert out.read_bytes() == ref.read_bytes()
    assert history(loss_path) == ref_history
    assert not list(tmp_path.glob(".*.tmp*"))


def test_hundred_sigusr1_leave_history_unchanged(tmp_path, setup):
    experiment, data, ref, ref_history = setup
    out = tmp_path / "tiny.ckpt"
    loss_path = out.with_name("tiny.loss.json")
    proc = subprocess.Popen(train_cmd(experiment, data, out, "--max-steps", "200"), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: steps_logged(loss_path) > 0, proc)
    rnd = random.Random(2)
    for i in range(100):
        proc.send_signal(signal.SIGUSR1)
        time.sleep(rnd.uniform(0.001, 0.02))
        if i % 10 == 9:  # let a step boundary pass now and then, however slow the machine
            seen = steps_logged(loss_path)
            wait_for(lambda: steps_logged(loss_path) > seen, proc)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    proc.stderr.close()
    snapshots = [json.loads(line) for line in open(loss_path) if '"SIGUSR1"' in line]
    print(f"\n100 SIGUSR1 -> {len(snapshots)} checkpoints")
    assert len(snapshots) >= 10
    assert history(loss_path) == ref_history[:200]


def train_in_process(experiment, data, out, *extra):
    return cli_main(["train", "--experiment", str(experiment), "--data", str(data), "--out", str(out),
                     "--engine", "numpy", *extra])


def inject_nan_at_step(monkeypatch, step: int):
    """Make the embedding gradient NaN during optimizer step `step` (two micro-batches a step)."""
    calls = {"n": 0}
    original = NumpyEngine.embed_bwd

    def embed_bwd(self, dwte, dwpe, dout, tokens, **kw):
        original(self, dwte, dwpe, dout, tokens, **kw)
        calls["n"] += 1
        if calls["n"] == 2 * step:
            dwte[3, 5] = np.nan

    monkeypatch.setattr(NumpyEngine, "embed_bwd", embed_bwd)


def test_nan_stops_before_the_update(tmp_path, setup, monkeypatch, capsys):
    experiment, data, ref, ref_history = setup
    out = tmp_path / "tiny.ckpt"
    inject_nan_at_step(monkeypatch, 7)
    assert train_in_process(experiment, data, out, "--max-steps", "12") == 3
    err = capsys.readouterr().err
    assert "step 7: non-finite gradient norm" in err and "wte" in err and "last good checkpoint is step 6" in err
    assert assert_intact(out) == 6
    assert history(out.with_name("tiny.loss.json")) == ref_history[:6]
    monkeypatch.undo()
    assert train_in_process(experiment, data, out, "--max-steps", "12", "--resume") == 0
    assert history(out.with_name("tiny.loss.json")) == ref_history[:12]


def test_checkpoints_are_written_behind_the_loop(tmp_path, setup, monkeypatch):
    """The loop copies a checkpoint to the host and checks it; the book's writer thread writes it while the loop trains
    on. Held until the loop has recorded step 7, the step-5 write returns (a loop that waited for it never would);
    its event comes after the write, it writes step 5's state, and the run's bytes, history and state are the
    reference run's."""
    from andrea.run import run_book

    experiment, data, ref, ref_history = setup
    out = tmp_path / "tiny.ckpt"
    loss_path = out.with_name("tiny.loss.json")
    real = run_book.write_checkpoint

    def held_write(path, step, params, m, v):
        if Path(path) == out and step == 5:
            deadline = time.monotonic() + 60
            while steps_logged(loss_path) < 7:  # two more steps: the step-7 checkpoint then waits for this one
                assert time.monotonic() < deadline, "the loop waited for the step-5 checkpoint write"
                time.sleep(0.005)
            real(tmp_path / "held5.ckpt", step, params, m, v)  # what the loop handed over, two steps later
        real(path, step, params, m, v)

    monkeypatch.setattr(run_book, "write_checkpoint", held_write)
    assert train_in_process(experiment, data, out, "--max-steps", "12") == 0
    lines = [json.loads(line) for line in open(loss_path)]
    position = {("step", r["step"]) if "loss" in r else (r["event"], r.get("step")): i for i, r in enumerate(lines)}
    assert position[("checkpoint", 5)] > position[("step", 7)]  # announced once written, not when asked
    assert [r["step"] for r in lines if r.get("event") == "checkpoint"] == list(range(1, 13))
    assert history(loss_path) == ref_history[:12]
    assert assert_intact(out) == 12
    unheld = tmp_path / "unheld" / "tiny.ckpt"
    assert train_in_process(experiment, data, unheld, "--max-steps", "12") == 0
    assert out.read_bytes() == unheld.read_bytes()
    # the copy the step-5 write got is step 5's state, untouched by the steps trained while it waited
    assert train_in_process(experiment, data, tmp_path / "five" / "tiny.ckpt", "--max-steps", "5") == 0
    assert (tmp_path / "held5.ckpt").read_bytes() == (tmp_path / "five" / "tiny.ckpt").read_bytes()


def test_checkpoint_copies_reuse_their_host_arrays(tmp_path, setup, monkeypatch):
    """Twelve checkpoints (and a best one) are copied into at most WRITES_IN_FLIGHT sets of host arrays, new ones only
    while fewer exist: a set is filled again once no write reads it (the write-behind test above checks that a held
    write's copy is never overwritten), and the checkpoint's bytes are those of copies made into new arrays."""
    from andrea.run.run_book import WRITES_IN_FLIGHT
    from andrea.schedule.model import Model

    experiment, data, _, ref_history = setup
    real, seen = Model.host_state, []

    def host_state(self, out=None):
        state = real(self, out=out)
        seen.append(tuple(id(a) for a in state))
        assert out is None or all(a is b for a, b in zip(state, out))
        return state

    monkeypatch.setattr(Model, "host_state", host_state)
    out = tmp_path / "tiny.ckpt"
    assert train_in_process(experiment, data, out, "--max-steps", "12") == 0
    assert len(seen) == 12 and 1 <= len(set(seen)) <= WRITES_IN_FLIGHT
    assert history(out.with_name("tiny.loss.json")) == ref_history[:12]
    monkeypatch.setattr(Model, "host_state", lambda self, out=None: real(self))  # new arrays at every checkpoint
    fresh = tmp_path / "fresh" / "tiny.ckpt"
    assert train_in_process(experiment, data, fresh, "--max-steps", "12") == 0
    assert out.read_bytes() == fresh.read_bytes()


def test_nan_step_can_be_skipped(tmp_path, setup, monkeypatch):
    experiment, data, ref, _ = setup
    out = tmp_path / "tiny.ckpt"
    inject_nan_at_step(monkeypatch, 4)
    assert train_in_process(experiment, data, out, "--max-steps", "8", "--on-nonfinite", "skip") == 0
    state = json.loads(out.with_name("tiny.state.json").read_text())
    assert state["skipped_steps"] == [4] and state["step"] == 8
    assert assert_intact(out) == 8
    steps = [r["step"] for r in history(out.with_name("tiny.loss.json"))]
    assert steps == [1, 2, 3, 5, 6, 7, 8]


def failing_fsync(monkeypatch, fragment: str, code: int, after: int):
    """os.fsync fails with `code` for files whose path contains `fragment`, after `after` successes."""
    real = os.fsync
    seen = {"n": 0}

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else ""
        if fragment in path:
            seen["n"] += 1
            if seen["n"] > after:
                raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_checkpoint_write_fault_keeps_previous(tmp_path, setup, monkeypatch, capsys, code):
    experiment, data, ref, ref_history = setup
    out = tmp_path / "tiny.ckpt"
    failing_fsync(monkeypatch, ".tiny.ckpt.tmp", code, after=5)
    assert train_in_process(experiment, data, out, "--max-steps", "10") == 2
    err = capsys.readouterr().err
    assert os.strerror(code) in err and "could not write the step-6 checkpoint" in err
    assert "previous checkpoint (step 5) is intact" in err and "Traceback" not in err
    assert assert_intact(out) == 5
    assert not list(tmp_path.glob(".*.tmp*"))
    monkeypatch.undo()
    assert train_in_process(experiment, data, out, "--max-steps", "10", "--resume") == 0
    assert history(out.with_name("tiny.loss.json")) == ref_history[:10]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_shard_write_fault_keeps_previous(tmp_path, monkeypatch, code):
    path = tmp_path / "train.bin"
    write_shard(path, np.arange(100))
    before = path.read_bytes()
    failing_fsync(monkeypatch, ".train.bin.tmp", code, after=0)
    with pytest.raises(OSError) as err:
        write_shard(path, np.arange(5000))
    assert err.value.errno == code
    assert path.read_bytes() == before and read_shard(path).size == 100
    assert not list(tmp_path.glob(".*.tmp*"))


def test_supervisor_restarts_a_killed_child(tmp_path, setup):
    experiment, data, ref, ref_history = setup
    out = tmp_path / "tiny.ckpt"
    loss_path = out.with_name("tiny.loss.json")
    sup = subprocess.Popen(train_cmd(experiment, data, out, "--supervise", "--max-steps", "120"),
                           stderr=subprocess.PIPE, text=True)
    wait_for(lambda: steps_logged(loss_path) >= 30, sup)
    children = Path(f"/proc/{sup.pid}/task/{sup.pid}/children").read_text().split()
    assert len(children) == 1
    os.kill(int(children[0]), signal.SIGKILL)
    assert sup.wait(timeout=180) == 0
    assert "restart 1 of 3" in sup.stderr.read()
    sup.stderr.close()
    restarts = [json.loads(line) for line in open(loss_path) if '"restart"' in line]
    assert restarts == [dict(restarts[0], attempt=1, cause="killed by SIGKILL")]
    assert json.loads(out.with_name("tiny.state.json").read_text())["restarts"] == 1
    assert history(loss_path) == ref_history[:120]
    ref_120 = tmp_path / "ref120" / "tiny.ckpt"
    run(train_cmd(experiment, data, ref_120, "--max-steps", "120"))
    assert out.read_bytes() == ref_120.read_bytes()
