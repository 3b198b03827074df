"""A run's artifacts know what they were made from, and nothing uses or overwrites the wrong one: resume never
destroys another trajectory's files, every consumer checks the data and tokenizer it is handed against the run's
state, the best checkpoint is a checkpoint like any other, untrustworthy numbers are refused."""

import json
import shutil

import numpy as np
import pytest
from conftest import train_numpy, write_experiment

from andrea.store.checkpoint import read_checkpoint, write_checkpoint
from andrea.cli import main as cli_main
from andrea.common.hashing import sha256_file
from andrea.store.runfiles import EXIT_NONFINITE, RunFiles, iter_records
from andrea.store.shards import read_shard, write_shard

MAIN, POLISH = 4, 2
N_TINY = 135_808  # ANDREA-tiny's parameters


@pytest.fixture
def two_phase(tmp_path, tiny_experiment_raw):
    raw = {k: v for k, v in tiny_experiment_raw.items() if k not in ("train", "schedule")}
    raw["phases"] = [
        {"name": "main", "length": {"steps": MAIN}, "lr": {"warmup_steps": 1, "decay": "constant"}},
        {"name": "polish", "length": {"steps": POLISH}, "lr": {"decay": "linear", "final_ratio": 0.1}},
    ]
    raw["intervals"] = {"checkpoint": 0, "sample": 0, "eval": 2, "eval_batches": 1}
    return write_experiment(tmp_path, raw)


@pytest.fixture
def finished(tmp_path, two_phase, chat_data):
    """A finished two-phase run on a copy of the chat data (its own folder, so a test may rewrite it)."""
    data = tmp_path / "tokens"
    shutil.copytree(chat_data, data)
    out = tmp_path / "run" / "tiny.ckpt"
    assert train_numpy(two_phase, data, out) == 0
    return RunFiles(out), data


def tree_bytes(*paths) -> dict:
    """sha256 of every file under `paths` (files or folders)."""
    out = {}
    for path in paths:
        for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            out[str(f)] = sha256_file(f)
    return out


def test_resume_with_the_checkpoint_removed_refuses_and_keeps_best_state_and_archive(finished, two_phase, capsys):
    files, data = finished
    kept = tree_bytes(files.best, files.state, files.archive)
    assert len(kept) == 4  # best, state, and the main phase's archive (checkpoint, state)
    files.ckpt.unlink()
    capsys.readouterr()
    assert train_numpy(two_phase, data, files.ckpt, "--resume") == 2
    err = capsys.readouterr().err
    assert "tiny.ckpt: missing, but tiny.state.json" in err and "tiny.archive/ (main)" in err
    assert "Memory plan" not in err  # refused before the engine is built
    assert tree_bytes(files.best, files.state, files.archive) == kept
    assert not files.ckpt.exists()
    # a fresh start on the same --out is refused too
    assert train_numpy(two_phase, data, files.ckpt) == 2
    assert tree_bytes(files.best, files.state, files.archive) == kept


def test_resume_after_an_interrupted_first_checkpoint_starts_over(tmp_path, two_phase, chat_data):
    """The state is written before its checkpoint: a kill between them, in the first checkpoint ever, leaves a
    state and no checkpoint; that run never completed a checkpoint, so --resume starts it over."""
    out = tmp_path / "run" / "tiny.ckpt"
    assert train_numpy(two_phase, chat_data, out, "--max-steps", "2") == 0
    files = RunFiles(out)
    reference = out.read_bytes()
    out.unlink()
    history = files.loss.read_text().splitlines()
    files.loss.write_text("".join(line + "\n" for line in history if '"event": "checkpoint"' not in line))
    assert train_numpy(two_phase, chat_data, out, "--resume", "--max-steps", "2") == 0
    assert out.read_bytes() == reference


def test_a_nan_in_m_is_refused_by_init_from_and_resume(finished, two_phase, tmp_path, capsys):
    files, data = finished
    step, params, m, v = read_checkpoint(files.ckpt)
    m[123] = np.nan
    bad = tmp_path / "bad" / "tiny.ckpt"
    bad.parent.mkdir()
    write_checkpoint(bad, step, params, m, v)
    capsys.readouterr()
    assert train_numpy(two_phase, data, tmp_path / "new" / "tiny.ckpt", "--init-from", str(bad)) == 2
    err = capsys.readouterr().err
    assert "1 of the 135,808 values of m are NaN or infinite (the first at index 123" in err and "Memory plan" not in err
    # a negative v, read by --resume (the state is rewritten to vouch for the bad file, as it would be after a
    # checkpoint written by a faulty build)
    v[7] = -1.0
    m[123] = 0.0
    write_checkpoint(files.ckpt, step, params, m, v)
    state = json.loads(files.state.read_text())
    state["checkpoints"][-1]["sha256"] = sha256_file(files.ckpt)
    files.state.write_text(json.dumps(state))
    assert train_numpy(two_phase, data, files.ckpt, "--resume") == 2
    assert "1 of the 135,808 values of v are NaN, infinite or negative (the first at index 7" in capsys.readouterr().err


def test_an_update_that_leaves_a_nan_is_never_checkpointed(tmp_path, two_phase, chat_data, monkeypatch):
    """State gone bad in memory (here: m poisoned after the start) passes the loss and gradient-norm gate for a
    step; the checkpoint gate stops the run before anything of it is written."""
    from andrea.run.train import Trainer

    original = Trainer.start_step

    def poisoned(self, stop):
        step = original(self, stop)
        m = self.engine.to_host(self.model.buf["m"]).copy()
        m[5] = np.nan
        self.engine.upload(self.model.buf["m"], m)
        return step

    monkeypatch.setattr(Trainer, "start_step", poisoned)
    out = tmp_path / "run" / "tiny.ckpt"
    raw = json.loads(two_phase.read_text())
    raw["intervals"]["checkpoint"] = 1
    for action in ("stop", "skip"):
        folder = out.with_name(action)
        assert train_numpy(write_experiment(tmp_path, raw), chat_data, folder / "tiny.ckpt",
                           "--on-nonfinite", action) == EXIT_NONFINITE
        assert not (folder / "tiny.ckpt").exists() and not (folder / "tiny.state.json").exists()
        events = [r for r in iter_records(folder / "tiny.loss.json") if r.get("event") == "nonfinite"]
        assert events and events[-1]["action"] == "stop" and "values of weights are NaN" in events[-1]["detail"]


def test_resume_on_other_data_is_refused_unless_switched(finished, two_phase, tmp_path, capsys):
    files, data = finished
    other = tmp_path / "other"
    shutil.copytree(data, other)
    write_shard(other / "train.bin", np.array(read_shard(other / "train.bin"))[::-1].copy())
    (other / "train.bin.manifest.json").unlink()  # a hand-made shard: hashed by the trainer itself
    raw = json.loads(two_phase.read_text())
    raw["phases"].append({"name": "more", "length": {"steps": 2}})  # a phase not yet run: steps to train
    longer = write_experiment(tmp_path, raw, "longer.json")
    before = files.state.read_bytes()
    capsys.readouterr()
    assert train_numpy(longer, other, files.ckpt, "--resume") == 2
    err = capsys.readouterr().err
    assert "cannot resume: it was trained on" in err and "train.bin: trained on sha256" in err and "--switch-data" in err
    assert "Memory plan" not in err and files.state.read_bytes() == before
    assert train_numpy(longer, other, files.ckpt, "--resume", "--switch-data") == 0
    state = json.loads(files.state.read_text())
    assert state["data"]["dir"] == str(other) and state["data_history"][0]["until_step"] == MAIN + POLISH
    assert state["data_history"][0]["data"]["dir"] == str(data)
    switched = [r for r in iter_records(files.loss) if r.get("event") == "data_switched"]
    assert len(switched) == 1 and switched[0]["step"] == MAIN + POLISH


def test_the_best_checkpoint_serves_sample_eval_export_and_inspect_with_no_extra_flags(finished, tmp_path, capsys):
    files, _ = finished
    state = json.loads(files.state.read_text())
    assert state["best"]["sha256"] == sha256_file(files.best)
    assert cli_main(["sample", "--ckpt", str(files.best), "--prompt", "hello", "--max-new-tokens", "4",
                     "--engine", "numpy", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == state["best"]["step"]
    assert cli_main(["eval", "--ckpt", str(files.best), "--out", str(tmp_path / "eval.json"), "--engine", "numpy"]) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["checkpoint"]["vouched_for_by_state"] is True and report["checkpoint"]["step"] == state["best"]["step"]
    assert cli_main(["export-hf", str(files.best), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    capsys.readouterr()
    assert cli_main(["inspect", str(files.best), "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert inspected["state"]["role"] == "best" and inspected["state"]["vouches_for_this_file"] is True
    # a best checkpoint its state does not vouch for is refused, naming the state
    step, params, m, v = read_checkpoint(files.best)
    write_checkpoint(files.best, step, params * 0.5, m, v)
    assert cli_main(["sample", "--ckpt", str(files.best), "--prompt", "hello", "--engine", "numpy"]) == 2
    assert "is not the best checkpoint it records (" in capsys.readouterr().err


def test_eval_refuses_other_validation_data_unless_asked_and_says_so(finished, tmp_path, capsys):
    files, data = finished
    out = tmp_path / "eval.json"
    assert cli_main(["eval", "--ckpt", str(files.ckpt), "--out", str(out), "--engine", "numpy"]) == 0
    assert json.loads(out.read_text())["data_as_trained"] is True  # --data from the state
    other = tmp_path / "other"
    shutil.copytree(data, other)
    write_shard(other / "val.bin", np.array(read_shard(data / "train.bin"))[:4096].copy())
    for stale in (other / "val.bin.manifest.json", other / "val.mask.bin", other / "val.mask.bin.manifest.json"):
        stale.unlink(missing_ok=True)
    out.unlink()
    args = ["eval", "--ckpt", str(files.ckpt), "--data", str(other), "--out", str(out), "--engine", "numpy"]
    capsys.readouterr()
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert f"but --data {other} holds other validation data (val.bin: trained on sha256" in err and not out.exists()
    assert cli_main(args + ["--other-data"]) == 0
    assert json.loads(out.read_text())["data_as_trained"] is False


def test_sample_refuses_a_tokenizer_rewritten_since_training(finished, capsys):
    files, data = finished
    tokenizer = json.loads((data / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = dict(reversed(list(tokenizer["model"]["vocab"].items())))
    (data / "tokenizer.json").write_text(json.dumps(tokenizer))
    capsys.readouterr()
    assert cli_main(["sample", "--ckpt", str(files.ckpt), "--prompt", "hello", "--engine", "numpy"]) == 2
    err = capsys.readouterr().err
    assert "was trained with the tokenizer of sha256" in err and str(data / "tokenizer.json") in err


@pytest.mark.parametrize("text, says", [
    ("[" * 100_000, "nested deeper than a run's state ever is"),
    ("[1, 2]", "not a run's state (a JSON object)"),
    ("{\"experiment\": ", "not valid JSON"),
])
def test_a_damaged_state_is_one_sentence(tmp_path, text, says, capsys):
    ckpt = tmp_path / "x.ckpt"
    write_checkpoint(ckpt, 1, *(np.zeros(N_TINY, np.float32) for _ in range(3)))
    RunFiles(ckpt).state.write_text(text)
    assert cli_main(["inspect", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def test_cpu_max_steps_trains_the_first_steps_and_says_the_run_is_unfinished(tmp_path, two_phase, chat_data, capsys):
    """On the NumPy engine --cpu-max-steps stops early; the log, the state and inspect say so, and --resume
    continues the same program to the bytes of an uninterrupted run."""
    out = tmp_path / "cpu" / "tiny.ckpt"
    assert train_numpy(two_phase, chat_data, out, "--cpu-max-steps", "3") == 0
    err = capsys.readouterr().err
    assert "trains the first 3 of the program's 6 steps (--cpu-max-steps)" in err
    assert "done: step 3 of 6; unfinished: stopped by --cpu-max-steps; `andrea train --resume` on a GPU" in err
    state = json.loads(RunFiles(out).state.read_text())
    assert (state["step"], state["total_steps"], state["unfinished"]) == (3, 6, "cpu-max-steps")
    assert cli_main(["inspect", str(out)]) == 0
    assert "step 3 of 6 (unfinished: stopped by --cpu-max-steps" in capsys.readouterr().out
    assert train_numpy(two_phase, chat_data, out, "--resume") == 0
    assert json.loads(RunFiles(out).state.read_text())["unfinished"] is None
    reference = tmp_path / "ref" / "tiny.ckpt"
    assert train_numpy(two_phase, chat_data, reference) == 0
    assert out.read_bytes() == reference.read_bytes()
