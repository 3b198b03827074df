"""Training phases: the pivot's checkpoint and archive, one loss history across phases, warmup-stable-decay,
resume anywhere (across a pivot too) bit-exactly, which phase changes a resume takes, the best checkpoint."""

import json
import os
import signal

import pytest
from conftest import train_numpy, write_experiment

from andrea.store.checkpoint import read_header
from andrea.cli import main as cli_main
from andrea.spec.config import validate
from andrea.common.errors import AndreaError
from andrea.common.hashing import sha256_file
from andrea.store.runfiles import iter_records, read_loss_history
from andrea.run.run_book import RunBook

MAIN, POLISH = 6, 4


@pytest.fixture
def two_phase(tmp_path, tiny_experiment_raw):
    raw = {k: v for k, v in tiny_experiment_raw.items() if k not in ("train", "schedule")}
    raw["phases"] = [
        {"name": "main", "length": {"steps": MAIN}, "lr": {"warmup_steps": 2, "decay": "constant"}},
        {"name": "polish", "length": {"steps": POLISH}, "lr": {"decay": "linear", "final_ratio": 0.1},
         "loss_on": "assistant", "intervals": {"eval": 2}},
    ]
    raw["intervals"] = {"checkpoint": 0, "sample": 3, "eval": 3, "eval_batches": 2}
    return raw


write = write_experiment  # write(tmp_path, raw[, name]): an experiment JSON
train = train_numpy


def test_warmup_stable_decay_learning_rates(two_phase):
    program = validate(two_phase).program(10**6)
    lrs = [program.lr_at(s) for s in range(MAIN + POLISH)]
    peak = two_phase["optimizer"]["lr"]
    assert lrs[:MAIN] == [peak / 2, peak, peak, peak, peak, peak]
    assert lrs[MAIN] == peak and lrs[-1] == pytest.approx(0.1 * peak)
    assert all(a > b for a, b in zip(lrs[MAIN:], lrs[MAIN + 1:]))
    assert [program.phase_at(s).name for s in (0, MAIN - 1, MAIN, MAIN + POLISH - 1)] == ["main", "main", "polish", "polish"]


def test_a_two_phase_run_archives_the_first_and_logs_both(tmp_path, two_phase, chat_data):
    out = tmp_path / "run" / "tiny.ckpt"
    assert train(write(tmp_path, two_phase), chat_data, out) == 0
    archive = out.with_name("tiny.archive") / "main"
    assert sorted(p.name for p in archive.iterdir()) == ["tiny.ckpt", "tiny.samples.json", "tiny.state.json"]
    assert read_header(archive / "tiny.ckpt")[0] == MAIN
    state = json.loads((archive / "tiny.state.json").read_text())
    assert state["step"] == MAIN and [p["status"] for p in state["phases"]] == ["finished", "waiting"]
    assert json.loads((archive / "tiny.samples.json").read_text())[-1]["step"] == MAIN
    history = read_loss_history(out.with_name("tiny.loss.json"))
    assert [(r["step"], r["phase"]) for r in history] == [(s, "main" if s <= MAIN else "polish")
                                                          for s in range(1, MAIN + POLISH + 1)]
    assert all("val_loss_assistant" in r for r in history if "val_loss" in r)
    pivots = [r for r in iter_records(out.with_name("tiny.loss.json")) if r.get("event") == "pivot"]
    assert [(p["step"], p["from"], p["to"]) for p in pivots] == [(MAIN, "main", "polish")]
    final = json.loads(out.with_name("tiny.state.json").read_text())
    assert [p["status"] for p in final["phases"]] == ["finished", "finished"]
    # the best checkpoint is the recorded best step, by the assistant tokens' validation loss
    best = final["best"]
    assert best["metric"] == "val_loss_assistant"
    evals = {r["step"]: r["val_loss_assistant"] for r in history if "val_loss_assistant" in r}
    assert best["step"] == min(evals, key=evals.get) and best["value"] == min(evals.values())
    assert read_header(out.with_name("tiny.best.ckpt"))[0] == best["step"]
    assert sha256_file(out.with_name("tiny.best.ckpt")) == best["sha256"]


@pytest.fixture
def reference(tmp_path, two_phase, chat_data):
    ref = tmp_path / "ref" / "tiny.ckpt"
    assert train(write(tmp_path, two_phase), chat_data, ref) == 0
    return ref


def test_sigterm_right_after_the_pivot_then_resume_is_bit_identical(tmp_path, two_phase, chat_data, reference,
                                                                    monkeypatch):
    original = RunBook.pivot

    def pivot_then_sigterm(self, phase, step, elapsed):
        original(self, phase, step, elapsed)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(RunBook, "pivot", pivot_then_sigterm)
    experiment = write(tmp_path, two_phase)
    out = tmp_path / "run" / "tiny.ckpt"
    assert train(experiment, chat_data, out) == 0
    assert read_header(out)[0] == MAIN
    monkeypatch.undo()
    assert train(experiment, chat_data, out, "--resume") == 0
    assert out.read_bytes() == reference.read_bytes()
    assert out.with_name("tiny.best.ckpt").read_bytes() == reference.with_name("tiny.best.ckpt").read_bytes()
    strip = lambda path: [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s")} for r in read_loss_history(path)]
    assert strip(out.with_name("tiny.loss.json")) == strip(reference.with_name("tiny.loss.json"))


def test_a_run_killed_between_the_pivots_checkpoint_and_archive_archives_on_resume(tmp_path, two_phase, chat_data,
                                                                                   reference, monkeypatch):
    def killed(self, phase):
        raise SystemExit(137)

    monkeypatch.setattr(RunBook, "archive", killed)
    experiment = write(tmp_path, two_phase)
    out = tmp_path / "run" / "tiny.ckpt"
    with pytest.raises(SystemExit):
        train(experiment, chat_data, out)
    assert read_header(out)[0] == MAIN and not out.with_name("tiny.archive").exists()
    monkeypatch.undo()
    assert train(experiment, chat_data, out, "--resume") == 0
    assert read_header(out.with_name("tiny.archive") / "main" / "tiny.ckpt")[0] == MAIN
    assert out.read_bytes() == reference.read_bytes()


def test_a_resume_may_change_a_phase_not_yet_started_but_not_one_that_ran(tmp_path, two_phase, chat_data, capsys):
    experiment = write(tmp_path, two_phase)
    out = tmp_path / "run" / "tiny.ckpt"
    assert train(experiment, chat_data, out, "--max-steps", "3") == 0
    later = json.loads(json.dumps(two_phase))
    later["phases"][1]["length"] = {"steps": 2}
    assert train(write(tmp_path, later, "later.json"), chat_data, out, "--resume", "--max-steps", "4") == 0
    changed = [r for r in iter_records(out.with_name("tiny.loss.json")) if r.get("event") == "phases_changed"]
    assert changed and changed[0]["changed"] == ["polish"]
    ran = json.loads(json.dumps(later))
    ran["phases"][0]["lr"]["warmup_steps"] = 3
    capsys.readouterr()
    assert train(write(tmp_path, ran, "ran.json"), chat_data, out, "--resume") == 2
    err = capsys.readouterr().err
    assert "phase 'main' has already run" in err and "--init-from" in err


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(train={"steps": 5}), "has no 'train' or 'schedule'"),
    (lambda r: r["phases"].append(dict(r["phases"][0])), "used twice"),
    (lambda r: r["phases"][0].update(loss_on="users"), "loss_on"),
])
def test_bad_phases_are_one_sentence(two_phase, change, message):
    change(two_phase)
    with pytest.raises(AndreaError, match=message):
        validate(two_phase, "x.json")


def test_assistant_loss_without_masks_is_refused(tmp_path, two_phase, repetitive_data, capsys):
    assert train(write(tmp_path, two_phase), repetitive_data, tmp_path / "x.ckpt") == 2
    assert "no loss masks" in capsys.readouterr().err
