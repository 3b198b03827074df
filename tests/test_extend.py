"""Extending a run: an edit that leaves every step already run unchanged (a phase appended, a constant-LR last
phase made longer) continues with --resume and gives the bytes of the edited experiment run from scratch; an
edit that changes a step already run is refused, and the command the refusal suggests works as given."""

import json
import re
import shlex

import pytest
from conftest import train_numpy, write_experiment

from andrea.store.checkpoint import read_header
from andrea.cli import main as cli_main
from andrea.spec.config import continuation_refusal, validate
from andrea.store.runfiles import RunFiles, iter_records, read_loss_history

MAIN, POLISH = 4, 2
N_TOKENS = 10**6  # a train split: only lengths in epochs depend on it, and these are in steps


@pytest.fixture
def e1(tiny_experiment_raw):
    """Two phases: main at a constant learning rate, then polish (linear decay)."""
    raw = {k: v for k, v in tiny_experiment_raw.items() if k not in ("train", "schedule")}
    raw["phases"] = [
        {"name": "main", "length": {"steps": MAIN}, "lr": {"warmup_steps": 1, "decay": "constant"}},
        {"name": "polish", "length": {"steps": POLISH}, "lr": {"decay": "linear", "final_ratio": 0.1}},
    ]
    raw["intervals"] = {"checkpoint": 0, "sample": 0, "eval": 2, "eval_batches": 1}
    return raw


def edited(raw: dict, edit) -> dict:
    new = json.loads(json.dumps(raw))
    edit(new)
    return new


def appended(raw):
    return edited(raw, lambda r: r["phases"].append({"name": "more", "length": {"steps": 2},
                                                      "lr": {"decay": "constant", "peak": 0.001}}))


def refusal(old, new, step):
    return continuation_refusal(old, validate(new), step, N_TOKENS)


# ---- the rule ---------------------------------------------------------------------------------------------
def test_what_leaves_the_steps_run_unchanged_may_continue(e1, tiny_experiment_raw):
    total = MAIN + POLISH
    assert refusal(e1, e1, total) is None
    assert refusal(e1, appended(e1), total) is None
    longer_main = edited(e1, lambda r: r["phases"][0].update(length={"steps": MAIN + 3}))
    assert refusal(e1, longer_main, MAIN) is None  # main was the last phase run, at a constant rate
    longer_polish = edited(e1, lambda r: r["phases"][1].update(length={"steps": POLISH + 5}))
    assert refusal(e1, longer_polish, MAIN) is None  # polish not started: any length
    intervals = edited(e1, lambda r: r["phases"][1].update(intervals={"eval": 1}))
    assert refusal(e1, intervals, total) is None  # intervals do not change a step
    one = tiny_experiment_raw
    warmup = one["schedule"]["warmup_steps"]
    longer_one = edited(one, lambda r: r["train"].update(steps=one["train"]["steps"] * 2))
    assert refusal(one, longer_one, warmup) is None  # the warmup's rates do not depend on the length


@pytest.mark.parametrize("edit, step, says", [
    (lambda r: r["phases"][1].update(length={"steps": POLISH + 2}), MAIN + 2,  # its first rate is the peak
     f"phase 'polish' has already run (steps {MAIN + 1}-{MAIN + 2}) and its learning rate at step {MAIN + 2} would change"),
    (lambda r: r["phases"][0]["lr"].update(peak=0.001), 2, "phase 'main' has already run (steps 1-2) and its learning rate at step 1"),
    (lambda r: r["phases"][0].update(length={"steps": MAIN - 1}), MAIN, f"step {MAIN}"),
    (lambda r: r["phases"][0].update(length={"steps": MAIN + 1}), MAIN + 1, f"step {MAIN + 1}"),
    (lambda r: r["phases"][1].update(loss_on="assistant"), MAIN + 1, "loss_on"),
    (lambda r: r["phases"][0].update(mixing={"policy": "uniform"}), 1, "mixing"),
    (lambda r: r["phases"].pop(), MAIN + POLISH, f"{MAIN} steps"),
    (lambda r: r["optimizer"].update(weight_decay=0.0), 1, "optimizer"),
    (lambda r: r["phases"][0].update(name="stable"), 1, "'stable'"),
])
def test_what_changes_a_step_already_run_is_refused(e1, edit, step, says):
    why = refusal(e1, edited(e1, edit), step)
    assert why is not None and says in why, why
    assert refusal(e1, edited(e1, edit), 0) is None or "optimizer" in says  # nothing run: only the fixed sections


def test_a_one_phase_cosine_run_made_longer_is_refused(tiny_experiment_raw):
    one = tiny_experiment_raw
    longer = edited(one, lambda r: r["train"].update(steps=one["train"]["steps"] + 10))
    why = refusal(one, longer, one["schedule"]["warmup_steps"] + 2)
    assert why and "phase 'main'" in why and "learning rate" in why


# ---- extending a finished run ------------------------------------------------------------------------------
def steps_of(out):
    return [r["step"] for r in read_loss_history(RunFiles(out).loss)]


@pytest.mark.parametrize("extend", [
    appended,
    lambda raw: edited(raw, lambda r: r["phases"][1].update(length={"steps": POLISH + 3}, lr={"decay": "constant"})),
], ids=["a phase appended", "a constant-rate last phase made longer"])
def test_extending_a_finished_run_gives_the_bytes_of_the_extended_experiment(tmp_path, e1, chat_data, extend):
    if extend is not appended:  # E1 itself has the constant-rate polish, E2 a longer one
        e1 = edited(e1, lambda r: r["phases"][1].update(lr={"decay": "constant"}))
    e2 = extend(e1)
    total1 = validate(e1).total_steps(N_TOKENS)
    total2 = validate(e2).total_steps(N_TOKENS)
    ref, out = tmp_path / "ref" / "tiny.ckpt", tmp_path / "out" / "tiny.ckpt"
    assert train_numpy(write_experiment(tmp_path, e2, "e2.json"), chat_data, ref) == 0
    assert train_numpy(write_experiment(tmp_path, e1, "e1.json"), chat_data, out) == 0
    assert read_header(out)[0] == total1
    files = RunFiles(out)
    # a resume that stops where E1 ended: the state says at once that the run is E2's, unfinished
    assert train_numpy(write_experiment(tmp_path, e2, "e2.json"), chat_data, out, "--resume",
                       "--max-steps", str(total1)) == 0
    state = json.loads(files.state.read_text())
    assert (state["experiment"], state["total_steps"], state["unfinished"]) == (e2, total2, "max-steps")
    assert train_numpy(write_experiment(tmp_path, e2, "e2.json"), chat_data, out, "--resume") == 0
    assert read_header(out)[0] == total2 and out.read_bytes() == ref.read_bytes()
    assert steps_of(out) == list(range(1, total2 + 1))
    extended = [r for r in iter_records(files.loss) if r.get("event") == "extended"]
    assert [(e["step"], e["total_before"], e["total_steps"]) for e in extended] == [(total1, total1, total2)]
    state = json.loads(files.state.read_text())
    assert state["experiment"] == e2 and state["unfinished"] is None and state["total_steps"] == total2
    assert [p["status"] for p in state["phases"]] == ["finished"] * len(e2["phases"])
    assert state["train_tokens"] > 0
    assert continuation_refusal(state["experiment"], validate(e2), state["step"], state["train_tokens"]) is None
    # every phase followed by another has its archive at its end, as in the run from scratch
    for phase in validate(e2).program(state["train_tokens"]).phases[:-1]:
        assert read_header(files.phase_archive(phase.name) / "tiny.ckpt")[0] == phase.end
    assert sorted(p.name for p in files.archive.iterdir()) == sorted(p.name for p in RunFiles(ref).archive.iterdir())
    # the best checkpoint carried on: the state vouches for it, at a step with the best headline value
    history = read_loss_history(files.loss)
    best = state["best"]
    assert best["value"] == min(r[best["metric"]] for r in history if best["metric"] in r)
    assert read_header(files.best)[0] == best["step"]


# ---- a refusal's command ----------------------------------------------------------------------------------
def suggested(err: str) -> list[str]:
    commands = re.findall(r"`(andrea train [^`]*)`", err)
    assert len(commands) == 1, err
    return shlex.split(commands[0])[1:]  # less the program's name: cli_main takes the arguments


@pytest.mark.parametrize("edit", [
    lambda r: r["phases"][0]["lr"].update(peak=0.001),  # a phase that ran changes
    lambda r: r["optimizer"].update(weight_decay=0.0),  # a fixed section changes
    lambda r: r["model"].update(n_layer=1),  # another model: its weights do not fit
], ids=["phase", "optimizer", "model"])
def test_the_command_a_refusal_suggests_succeeds_as_given(tmp_path, e1, chat_data, capsys, edit):
    out = tmp_path / "run dir" / "tiny.ckpt"  # a space: the paths are quoted
    assert train_numpy(write_experiment(tmp_path, e1, "e1.json"), chat_data, out, "--max-steps", "2") == 0
    changed = write_experiment(tmp_path, edited(e1, edit), "changed.json")
    capsys.readouterr()
    assert train_numpy(changed, chat_data, out, "--resume", "--max-steps", "3") == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err
    argv = suggested(err)
    new_out = argv[argv.index("--out") + 1]
    assert not RunFiles(new_out).ckpt.exists() and RunFiles(new_out).ckpt.parent == out.parent
    assert cli_main(argv) == 0
    assert read_header(new_out)[0] == 3 and read_header(out)[0] == 2
