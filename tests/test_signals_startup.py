"""SIGTERM / SIGUSR1 at any moment after `andrea train` starts, the trainer's clocks, and the range checks
of a few options.

A signal is sent 0 to 500 ms after the command is started, to the trainer and to its supervisor: it is
honoured (SIGUSR1 writes a checkpoint, SIGTERM ends the run with --sigterm-exit-code) or deferred, never
fatal, and the supervisor uses up no restart for it. A process started the way the supervisor and the
--gpus launcher start theirs (both signals blocked across the exec) is covered from its first instant;
one started plainly only from its first line of Python (docs/RELIABILITY.md), hence the later offsets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from andrea.store.shards import write_shard
from conftest import EXPERIMENTS, train_numpy

STEPS = 400
MAX_STEPS = 60  # long enough that a signal at 500 ms lands before the last step (about 1 s of training)
OFFSETS_MS = list(range(0, 501, 50))
FAST_MS = (0, 100, 250)  # the subset outside the slow mark
PLAIN_OFFSETS_MS = list(range(100, 501, 50))  # a plainly started process: after its interpreter's start-up
SIGTERM_EXIT = 75


def offsets(values, fast=FAST_MS):
    return [ms if ms in fast else pytest.param(ms, marks=pytest.mark.slow) for ms in values]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny experiment (no interval checkpoints, no samples) and a repetitive token stream."""
    root = tmp_path_factory.mktemp("signals")
    raw = json.loads((EXPERIMENTS / "ANDREA-tiny-TRAIN.json").read_text())
    raw["train"] = {"steps": STEPS}
    raw["intervals"] = {"checkpoint": 0, "sample": 0, "eval": 0, "eval_batches": 1}
    experiment = root / "tiny.json"
    experiment.write_text(json.dumps(raw))
    data = root / "tokens"
    data.mkdir()
    pattern = np.random.default_rng(0).integers(0, 512, 300)
    write_shard(data / "train.bin", np.tile(pattern, 40))
    write_shard(data / "val.bin", np.tile(pattern, 4))
    return experiment, data


def andrea_command() -> list[str]:
    """The `andrea` console script beside this interpreter, as a user runs it."""
    script = Path(sys.executable).with_name("andrea")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "andrea.cli"]


def start(cmd: list[str], stderr, blocked: bool) -> subprocess.Popen:
    """Start `cmd`; `blocked`: with SIGTERM/SIGUSR1 blocked across the exec, as a supervisor starts its trainer."""
    if not blocked:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    try:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def signalled_run(tmp_path, tiny, signum, offset_ms, *extra, blocked=True):
    """`andrea train` with `signum` sent `offset_ms` after it started: (exit status, loss-history lines, stderr)."""
    experiment, data = tiny
    out = tmp_path / "run" / "tiny.ckpt"
    cmd = andrea_command() + ["train", "--experiment", str(experiment), "--data", str(data), "--out", str(out),
                              "--engine", "numpy", "--max-steps", str(MAX_STEPS),
                              "--sigterm-exit-code", str(SIGTERM_EXIT), *extra]
    with open(tmp_path / "stderr", "w") as err:
        proc = start(cmd, err, blocked)
        deadline = time.perf_counter() + offset_ms / 1000
        while (left := deadline - time.perf_counter()) > 0:
            time.sleep(left)
        proc.send_signal(signum)
        status = proc.wait(timeout=300)
    loss = out.with_name("tiny.loss.json")
    lines = [json.loads(line) for line in open(loss)] if loss.exists() else []
    return status, lines, (tmp_path / "stderr").read_text()


def said(stderr: str) -> str:
    """The lines of a run's stderr that tell what happened (not the memory plan)."""
    return "\n".join(line for line in stderr.splitlines()
                     if any(w in line for w in ("SIG", "restart", "error", "checkpoint", "killed", "Error")))


def check_sigusr1(status, lines, stderr):
    assert status == 0, f"exit status {status}\n{said(stderr)}"
    assert not [e for e in lines if e.get("event") == "restart"] and "restart" not in stderr
    snapshots = [e for e in lines if e.get("reason") == "SIGUSR1"]
    assert len(snapshots) == 1 and 1 <= snapshots[0]["step"] < MAX_STEPS, said(stderr)
    assert lines[-1] == dict(lines[-1], event="checkpoint", step=MAX_STEPS, reason="max-steps")


def check_sigterm(status, lines, stderr):
    assert status == SIGTERM_EXIT, f"exit status {status}\n{said(stderr)}"
    assert not [e for e in lines if e.get("event") == "restart"] and "restart" not in stderr
    trained = [r["step"] for r in lines if "loss" in r]
    if trained:  # a checkpoint of every step trained
        assert lines[-1] == dict(lines[-1], event="checkpoint", step=trained[-1], reason="SIGTERM")
        assert trained[-1] < MAX_STEPS
    else:  # stopped before the first step (the supervisor: before it started the trainer, no history)
        assert all(e.get("event") in ("start", "sigterm") for e in lines), lines


@pytest.mark.parametrize("offset_ms", offsets(OFFSETS_MS))
@pytest.mark.parametrize("supervise", [False, True], ids=["trainer", "supervised"])
def test_sigusr1_while_starting_is_a_checkpoint(tmp_path, tiny, supervise, offset_ms):
    check_sigusr1(*signalled_run(tmp_path, tiny, signal.SIGUSR1, offset_ms, *["--supervise"] * supervise))


@pytest.mark.parametrize("offset_ms", offsets(OFFSETS_MS))
@pytest.mark.parametrize("supervise", [False, True], ids=["trainer", "supervised"])
def test_sigterm_while_starting_ends_the_run(tmp_path, tiny, supervise, offset_ms):
    check_sigterm(*signalled_run(tmp_path, tiny, signal.SIGTERM, offset_ms, *["--supervise"] * supervise))


@pytest.mark.parametrize("offset_ms", offsets(PLAIN_OFFSETS_MS, fast=(150,)))
@pytest.mark.parametrize("supervise", [False, True], ids=["trainer", "supervised"])
def test_sigusr1_to_a_plainly_started_command(tmp_path, tiny, supervise, offset_ms):
    """Started as a shell starts it (nothing blocked): from its first line of Python on."""
    check_sigusr1(*signalled_run(tmp_path, tiny, signal.SIGUSR1, offset_ms, *["--supervise"] * supervise,
                                 blocked=False))


RANK = """
import sys, time
from andrea.run.stop_signals import STOP_SIGNALS
STOP_SIGNALS.install()
deadline = time.time() + 10
while not STOP_SIGNALS.snapshot and time.time() < deadline:
    time.sleep(0.005)
sys.exit(0 if STOP_SIGNALS.snapshot else 1)
"""


@pytest.fixture
def fake_cupy(monkeypatch):
    """launch() on a host without CUDA: two devices and an NCCL id, enough to start its ranks."""
    cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 2),
                                 nccl=types.SimpleNamespace(get_unique_id=lambda: bytes(range(128))))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)


@pytest.mark.parametrize("offset_ms", [0, 5, 10, 20, 40, 80])
def test_the_launcher_s_ranks_survive_a_sigusr1_while_they_start(fake_cupy, offset_ms):
    """The --gpus launcher forwards a SIGUSR1 to every rank, however soon after it started them."""
    from andrea.run.parallel import launch
    from andrea.run.stop_signals import STOP_SIGNALS

    STOP_SIGNALS.install()  # this process's own, as the command line's: a signal before launch() is recorded
    try:
        timer = threading.Timer(offset_ms / 1000, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        try:
            status = launch([sys.executable, "-c", RANK], 2, SIGTERM_EXIT)
        finally:
            timer.join()
    finally:
        STOP_SIGNALS.restore()
    assert status == 0  # not -10: each rank recorded the signal


# ---- clocks ----------------------------------------------------------------------------------------------

def clock(**calls):
    """A stand-in for the `time` module of andrea.run.train and andrea.run.run_book: the real one, with the named
    functions replaced."""
    return types.SimpleNamespace(**{**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")}, **calls})


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in open(out.with_name("tiny.loss.json"))]


def test_a_frozen_clock_gives_no_rate(tmp_path, tiny, monkeypatch):
    """Every clock stands still: steps take no time, so there is no rate (null), and nothing divides by zero."""
    import andrea.run.run_book
    import andrea.run.train

    frozen = clock(time=lambda: 1.7e9, perf_counter=lambda: 50.0, monotonic=lambda: 50.0)
    for module in (andrea.run.train, andrea.run.run_book):
        monkeypatch.setattr(module, "time", frozen)
    out = tmp_path / "tiny.ckpt"
    assert train_numpy(*tiny, out, "--max-steps", "3") == 0
    steps = [r for r in records(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["tokens_per_s"] is None and r["time"] == 0 for r in steps)


def test_a_wall_clock_stepped_back_leaves_elapsed_time_and_rates_positive(tmp_path, tiny, monkeypatch):
    """The wall clock jumps back an hour at every reading (NTP, a suspended VM): durations come from a
    monotonic clock, so the elapsed time only grows and every rate is positive."""
    import andrea.run.run_book
    import andrea.run.train

    readings = iter(range(0, -10**9, -3600))
    stepped_back = clock(time=lambda: 1.7e9 + next(readings))
    for module in (andrea.run.train, andrea.run.run_book):
        monkeypatch.setattr(module, "time", stepped_back)
    out = tmp_path / "tiny.ckpt"
    assert train_numpy(*tiny, out, "--max-steps", "5") == 0
    steps = [r for r in records(out) if "loss" in r]
    elapsed = [r["time"] for r in steps]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0
    assert all(r["tokens_per_s"] > 0 for r in steps)
    state = json.loads(out.with_name("tiny.state.json").read_text())
    assert state["elapsed_s"] >= elapsed[-1]


# ---- range checks ----------------------------------------------------------------------------------------

REQUIRED = ["--experiment", "exp.json", "--data", "data", "--out", "out/run.ckpt"]


@pytest.mark.parametrize("words, option, valid", [
    (["train", *REQUIRED, "--max-steps", "0"], "--max-steps", "at least 1"),
    (["train", *REQUIRED, "--max-steps", "-3"], "--max-steps", "at least 1"),
    (["train", *REQUIRED, "--max-steps", "two"], "--max-steps", "at least 1"),
    (["sample", "--ckpt", "a.ckpt", "--prompt", "hi", "--temperature", "-1"], "--temperature", "at least 0"),
    (["sample", "--ckpt", "a.ckpt", "--prompt", "hi", "--temperature", "nan"], "--temperature", "at least 0"),
    (["sample", "--ckpt", "a.ckpt", "--prompt", "hi", "--top-k", "-5"], "--top-k", "at least 0"),
    (["sample", "--ckpt", "a.ckpt", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens", "at least 1"),
])
def test_out_of_range_options_are_refused_at_parsing(words, option, valid, capsys):
    from andrea.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(words)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {option}: " in err and err.endswith(valid), err


@pytest.mark.parametrize("words, dest, value", [
    (["train", *REQUIRED, "--max-steps", "1"], "max_steps", 1),
    (["sample", "--ckpt", "a.ckpt", "--prompt", "hi", "--temperature", "0"], "temperature", 0.0),
    (["sample", "--ckpt", "a.ckpt", "--prompt", "hi", "--top-k", "0"], "top_k", 0),
])
def test_the_edges_of_the_ranges_are_accepted(words, dest, value):
    from andrea.cli import build_parser

    assert getattr(build_parser().parse_args(words), dest) == value


def test_a_trainer_that_dies_before_making_its_folder_is_restarted(tmp_path):
    """A trainer killed before it made the run's folder still counts as a restart, recorded in a new history."""
    from andrea.run.supervise import supervise

    args = types.SimpleNamespace(out=str(tmp_path / "new" / "run.ckpt"), resume=False, init_from=None, max_restarts=1,
                                 sigterm_exit_code=SIGTERM_EXIT)
    dies = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    assert supervise(args, dies) == 1  # gave up after its one restart
    restarts = [json.loads(line) for line in open(tmp_path / "new" / "run.loss.json")]
    assert [(r["event"], r["attempt"], r["cause"]) for r in restarts] == [("restart", 1, "killed by SIGKILL")]
