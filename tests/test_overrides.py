"""`andrea train --set KEY=VALUE`: a dotted path into the experiment (phases by name), the value as JSON when it
parses; unknown paths and bad values are one sentence naming the override; the run uses, hashes and records the
effective experiment; the supervisor's and the launcher's children get the overrides too."""

import argparse
import json

import pytest
from conftest import train_numpy, write_experiment

from andrea.store.checkpoint import read_header
from andrea.spec.config import apply_overrides, load_experiment, validate
from andrea.common.errors import AndreaError
from andrea.run.train import add_options, child_command


@pytest.fixture
def two_phase(tiny_experiment_raw):
    raw = {k: v for k, v in tiny_experiment_raw.items() if k not in ("train", "schedule")}
    raw["phases"] = [
        {"name": "main", "length": {"steps": 3}, "lr": {"warmup_steps": 1, "decay": "constant"}},
        {"name": "polish", "length": {"steps": 2}, "lr": {"decay": "linear"}},
    ]
    raw["intervals"] = {"checkpoint": 0, "sample": 0, "eval": 0, "eval_batches": 1}
    return raw


def test_overrides_address_phases_by_name_lists_by_index_and_parse_json(two_phase):
    before = json.dumps(two_phase)
    out = apply_overrides(two_phase, ["phases.main.length.steps=5", "phases.polish.lr.final_ratio=0.05",
                                      "optimizer.betas.1=0.99", "phases.polish.loss_on=assistant",
                                      "phases.polish.intervals.eval=2", 'description="a, b"', "seed=7",
                                      "phases.main.lr={\"decay\": \"cosine\"}"], "x.json")
    assert json.dumps(two_phase) == before  # a new dict; the one given is untouched
    main, polish = out["phases"]
    assert main["length"] == {"steps": 5} and main["lr"] == {"decay": "cosine"}
    assert polish["lr"]["final_ratio"] == 0.05 and polish["loss_on"] == "assistant"  # not JSON: a string
    assert polish["intervals"] == {"eval": 2}  # a key of the schema, absent from the file
    assert out["optimizer"]["betas"] == [two_phase["optimizer"]["betas"][0], 0.99]
    assert out["description"] == "a, b" and out["seed"] == 7
    validate(out)


@pytest.mark.parametrize("item, says", [
    ("optimizer.lrr=1", ["--set optimizer.lrr=1", "'lrr'", "betas, eps, grad_clip, lr, weight_decay"]),
    ("phases.warmup.length.steps=2", ["--set phases.warmup.length.steps=2", "'warmup'", "main, polish"]),
    ("optimizer.betas.2=0.5", ["--set optimizer.betas.2=0.5", "0, 1"]),
    ("phases.main.length.steps.x=1", ["--set phases.main.length.steps.x=1", "phases.main.length.steps is a value"]),
    ("optimizer.lr", ["--set optimizer.lr:", "KEY=VALUE"]),
    ("=3", ["--set =3:", "KEY=VALUE"]),
    ("optimizer..lr=3", ["--set optimizer..lr=3:", "KEY=VALUE"]),
])
def test_unknown_paths_and_malformed_items_are_one_sentence(two_phase, item, says):
    with pytest.raises(AndreaError) as err:
        apply_overrides(two_phase, [item], "x.json")
    message = str(err.value)
    assert message.startswith("x.json: ") and "\n" not in message
    for part in says:
        assert part in message


def test_an_invalid_value_is_the_schemas_error_naming_the_override(tmp_path, two_phase):
    path = write_experiment(tmp_path, two_phase)
    with pytest.raises(AndreaError, match=r"--set optimizer.lr=-1: field 'optimizer.lr': -1 is less than"):
        load_experiment(path, ["optimizer.lr=-1"])
    with pytest.raises(AndreaError, match=r"--set model.n_head=3: field 'model.d_model' \(64\) must be divisible"):
        load_experiment(path, ["model.n_head=3"])
    with pytest.raises(AndreaError, match=r"--set phases.polish.name=main: field 'phases': the name 'main'"):
        load_experiment(path, ["phases.polish.name=main"])
    assert load_experiment(path, ["seed=3"]).seed == 3


def test_a_run_with_overrides_is_the_run_of_the_edited_experiment(tmp_path, two_phase, chat_data):
    sets = ["phases.main.length.steps=2", "phases.polish.lr.final_ratio=0.5"]
    edited = json.loads(json.dumps(two_phase))
    edited["phases"][0]["length"]["steps"] = 2
    edited["phases"][1]["lr"]["final_ratio"] = 0.5
    ref, out = tmp_path / "ref" / "tiny.ckpt", tmp_path / "out" / "tiny.ckpt"
    assert train_numpy(write_experiment(tmp_path, edited, "edited.json"), chat_data, ref) == 0
    experiment = write_experiment(tmp_path, two_phase)
    assert train_numpy(experiment, chat_data, out, *[a for s in sets for a in ("--set", s)]) == 0
    assert read_header(out)[0] == 4 and out.read_bytes() == ref.read_bytes()
    state = json.loads(out.with_name("tiny.state.json").read_text())
    assert state["overrides"] == sets and state["experiment"] == edited
    assert state["trajectory_hash"] == validate(edited).trajectory_hash()
    assert [(p["name"], p["end"]) for p in state["phases"]] == [("main", 2), ("polish", 4)]
    # a resume with the same overrides continues; the file alone is another experiment
    assert train_numpy(experiment, chat_data, out, "--resume", *[a for s in sets for a in ("--set", s)]) == 0


def test_children_get_every_override():
    parser = argparse.ArgumentParser()
    add_options(parser)
    args = parser.parse_args(["--experiment", "e.json", "--data", "d", "--out", "o.ckpt", "--set", "seed=3",
                              "--set", "phases.main.length.steps=9", "--supervise"])
    cmd = child_command(args)
    assert cmd[cmd.index("--set"):cmd.index("--set") + 4] == ["--set", "seed=3", "--set", "phases.main.length.steps=9"]
    assert "--set" not in child_command(parser.parse_args(["--experiment", "e", "--data", "d", "--out", "o"]))
