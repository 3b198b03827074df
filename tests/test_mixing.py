"""Mixing of data sources (docs/FIREHOSE-BANDIT.md): the spec's update rule, the policies' batches, the
per-source accounting, bit-exact resume of a bandit run, and the errors."""

import json
import math
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from conftest import train_numpy, write_experiment

from andrea.store.checkpoint import read_header
from andrea.cli import main as cli_main
from andrea.spec.config import validate
from andrea.common.errors import AndreaError
from andrea.store.loader import TokenWindows
from andrea.store.mixing import MixState, Mixture, bandit_probabilities, bandit_update, systematic_rows
from andrea.store.runfiles import read_loss_history
from andrea.store.shards import mask_path, mask_writer, read_mask, read_shard, write_shard
from andrea.run.train import Trainer

SPEC = Path(__file__).resolve().parents[1] / "docs" / "FIREHOSE-BANDIT.md"
STEPS = 12


def spec_probabilities(losses, reward="progress", a=0.9, c=1.0):
    """The spec's rule, written again from docs/FIREHOSE-BANDIT.md with every arm drawn at every step."""
    K = len(losses[0])
    R, m, t = np.zeros(K), [None] * K, 0
    out = []

    def eps(t):
        return 1 / K if t == 0 else min(1 / K, math.sqrt(math.log(K) / (K * t)))

    for L in list(losses) + [None]:
        z = eps(t) * R
        soft = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        p = (1 - K * eps(t + 1)) * soft + eps(t + 1)
        out.append(p)
        if L is None:
            break
        for k in range(K):
            r = L[k] if reward == "loss" else (0.0 if m[k] is None else 100 * (m[k] - L[k]) / m[k])
            R[k] = a * R[k] + (1 - a) * c * r / p[k]
            m[k] = L[k] if m[k] is None else a * m[k] + (1 - a) * L[k]
        t += 1
    return out


def documented_example():
    rows = [line for line in SPEC.read_text().splitlines() if re.match(r"^\| \d+ \|", line)]
    table = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    probs = [[float(x) for x in r[1:4]] for r in table]
    losses = [[float(x) for x in r[4:7]] for r in table if r[4]]
    return probs, losses


def test_the_update_rule_gives_the_documented_probabilities():
    probs, losses = documented_example()
    assert len(probs) == len(losses) + 1 == 7
    state = MixState.fresh(3)
    params = {"reward": "progress", "smoothing": 0.9, "scale": 1.0}
    ours = []
    for L in losses + [None]:
        ours.append(bandit_probabilities(state.reward, [0, 1, 2], state.updates, 3))
        if L is not None:
            bandit_update(state, ours[-1], dict(enumerate(L)), params)
    rewritten = spec_probabilities(losses)
    for documented, mine, theirs in zip(probs, ours, rewritten):
        assert np.allclose(documented, mine, atol=5e-7) and np.allclose(mine, theirs, rtol=1e-12, atol=0)
    assert ours[-1][0] > ours[-1][1] > ours[-1][2], "the fastest-learning source gets most, the flat one least"
    # the loss reward on the same losses favours the flat source, as the spec says
    loss_state = MixState.fresh(3)
    for L in losses:
        p = bandit_probabilities(loss_state.reward, [0, 1, 2], loss_state.updates, 3)
        bandit_update(loss_state, p, dict(enumerate(L)), {**params, "reward": "loss"})
    final = bandit_probabilities(loss_state.reward, [0, 1, 2], loss_state.updates, 3)
    assert np.allclose(final, spec_probabilities(losses, reward="loss")[-1], rtol=1e-12, atol=0)
    assert np.allclose(final, [0.314094, 0.338208, 0.347698], atol=5e-7)


@pytest.mark.parametrize("probs", [[0.5, 0.5], [0.75, 0.25], [0.1, 0.0, 0.9], [0.0, 1.0], [0.3, 0.3, 0.4]])
def test_systematic_rows_give_each_source_its_share(probs):
    for u0 in (0.0, 0.37, 0.999999):
        rows = systematic_rows(probs, u0, 8)
        counts = np.bincount(rows, minlength=len(probs))
        assert rows == sorted(rows)
        for k, p in enumerate(probs):
            assert math.floor(8 * p) <= counts[k] <= math.ceil(8 * p)


def source_folder(root: Path, sizes: dict[str, int], seq_len: int = 8) -> Path:
    """Sources whose tokens say which source and position they are: token = 100 k + position mod 100."""
    for k, (name, n) in enumerate(sizes.items()):
        for split in ("train", "val"):
            tokens = 100 * k + np.arange(n) % 100 if n else np.zeros(0, dtype=np.int64)
            write_shard(root / name / f"{split}.bin", tokens)
    return root


def mixture(folder, spec, batch_size=8, seq_len=8, seed=3):
    raw = {"name": "m", "model": {"n_layer": 1, "d_model": 8, "n_head": 2, "vocab_size": 512, "seq_len": seq_len},
           "optimizer": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "grad_clip": 1.0},
           "batch": {"batch_size": batch_size, "micro_batches": 1}, "train": {"steps": 10},
           "schedule": {"warmup_steps": 0, "min_lr_ratio": 0.1}, "seed": seed, "precision": "fp32",
           "intervals": {"checkpoint": 0, "sample": 0, "eval": 0, "eval_batches": 1}, "mixing": spec}
    exp = validate(raw)
    windows = TokenWindows(folder / "train.bin", seq_len, seed)
    return Mixture(windows, exp.program(windows.tokens.size), seed, batch_size, "exp.json"), windows, exp


def test_each_policy_draws_its_shares_and_every_window_of_a_source_once_per_pass(tmp_path):
    folder = source_folder(tmp_path, {"alpha": 401, "beta": 161})  # 50 and 20 windows of 8
    for spec, expected in [({"policy": "uniform"}, [0.5, 0.5]), ({"policy": "proportional"}, [50 / 70, 20 / 70]),
                           ({"policy": "fixed", "weights": {"alpha": 1, "beta": 3}}, [0.25, 0.75]),
                           ({"policy": "fixed", "weights": {"beta": 2}}, [0.0, 1.0]),
                           ({"policy": "uniform", "sources": ["alpha"]}, [1.0, 0.0])]:
        mix, windows, exp = mixture(folder, spec)
        phase = exp.program(windows.tokens.size).phases[0]
        state = MixState.fresh(2)
        seen = {0: [], 1: []}
        for step in range(10):
            probs = mix.probabilities(phase, state)
            assert probs == pytest.approx(expected, abs=1e-15)
            ws, sources = mix.batch(step, probs, state)
            for w, k in zip(ws, sources):
                assert windows.window_source(w) == k
                seen[k].append(w)
            x, _ = windows.micro_batches_of(ws, 1)[0]
            assert all(int(row[0]) // 100 == k for row, k in zip(x, sources)), "each row is its source's tokens"
        assert state.draws == [len(seen[0]), len(seen[1])]
        for k, n in ((0, 50), (1, 20)):
            first_pass = seen[k][:n]
            if len(seen[k]) >= n:
                assert sorted(first_pass) == list(range(int(windows.window_offsets[k]), int(windows.window_offsets[k]) + n))


def test_the_batch_is_a_function_of_seed_step_and_state(tmp_path):
    folder = source_folder(tmp_path, {"alpha": 401, "beta": 161})
    mix, windows, exp = mixture(folder, {"policy": "fixed", "weights": {"alpha": 3, "beta": 5}})
    state = MixState(draws=[17, 4], reward=[0.0, 0.0], loss_mean=[None, None], updates=0, rows=[0, 0])
    probs = [0.3, 0.7]  # 2.4 and 5.6 rows of 8: the step's uniform decides 2 or 3
    a = mix.batch(5, probs, state.copy())
    again, _, _ = mixture(folder, {"policy": "fixed", "weights": {"alpha": 3, "beta": 5}})
    assert again.batch(5, probs, state.copy()) == a
    counts = {tuple(np.bincount(mix.batch(s, probs, state.copy())[1], minlength=2)) for s in range(20)}
    assert counts == {(2, 6), (3, 5)}
    other, _, _ = mixture(folder, {"policy": "fixed", "weights": {"alpha": 3, "beta": 5}}, seed=4)
    assert other.batch(5, probs, state.copy()) != a


@pytest.mark.parametrize("spec, sizes, message", [
    ({"policy": "uniform"}, {"alpha": 401, "empty": 5}, "'empty' .* has 5 tokens, fewer than one sequence of 9"),
    ({"policy": "bandit"}, {"alpha": 401, "empty": 0}, "'empty' .* has 0 tokens"),
    ({"policy": "fixed", "weights": {"alpha": 1, "gamma": 1}}, {"alpha": 401, "beta": 161}, "names the source 'gamma'"),
    ({"policy": "uniform", "sources": ["nope"]}, {"alpha": 401, "beta": 161}, "names the source 'nope'"),
    ({"policy": "fixed", "weights": {"alpha": 0}}, {"alpha": 401, "beta": 161}, "no source a weight above 0"),
])
def test_bad_mixes_and_sources_without_tokens_are_one_sentence(tmp_path, spec, sizes, message):
    folder = source_folder(tmp_path, sizes)
    with pytest.raises(AndreaError, match=message):
        mixture(folder, spec)


def test_a_zero_token_source_with_weight_zero_is_allowed(tmp_path):
    folder = source_folder(tmp_path, {"alpha": 401, "empty": 0})
    mix, windows, exp = mixture(folder, {"policy": "fixed", "weights": {"alpha": 1, "empty": 0}})
    phase = exp.program(windows.tokens.size).phases[0]
    assert mix.probabilities(phase, MixState.fresh(2)) == [1.0, 0.0]


@pytest.mark.parametrize("spec", [{"policy": "fixed"}, {"policy": "uniform", "weights": {"a": 1}},
                                  {"policy": "uniform", "reward": "loss"}, {"policy": "bandit", "reward": "gain"},
                                  {"policy": "bandit", "smoothing": 1.0}, {"policy": "sometimes"}])
def test_the_schema_refuses_bad_mixing_fields(tiny_experiment_raw, spec):
    with pytest.raises(AndreaError, match="field 'mixing"):
        validate({**tiny_experiment_raw, "mixing": spec})


# ---- training runs --------------------------------------------------------------------------------
@pytest.fixture
def bandit_raw(tiny_experiment_raw):
    raw = dict(tiny_experiment_raw)
    raw["mixing"] = {"policy": "bandit"}
    raw["train"] = {"steps": STEPS}
    raw["intervals"] = {"checkpoint": 3, "sample": 0, "eval": 4, "eval_batches": 2}
    return raw


write = write_experiment  # write(tmp_path, raw[, name]): an experiment JSON
train = train_numpy


def strip(path):
    return [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s")} for r in read_loss_history(path)]


@pytest.fixture
def bandit_reference(tmp_path, bandit_raw, two_sources):
    ref = tmp_path / "ref" / "mix.ckpt"
    assert train(write(tmp_path, bandit_raw), two_sources, ref) == 0
    return ref


def test_a_bandit_run_records_its_mixture_and_per_source_losses(bandit_reference, two_sources, bandit_raw, tmp_path):
    history = read_loss_history(bandit_reference.with_name("mix.loss.json"))
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    names = ["pydocs", "wordnet"]
    for r in history:
        assert sorted(r["mix"]) == names and sum(r["mix"].values()) == pytest.approx(1.0, abs=1e-12)
        assert sum(r["source_sequences"].values()) == bandit_raw["batch"]["batch_size"]
        # the per-source losses are the step's loss split by source: their row-weighted mean is the loss
        n = r["source_sequences"]
        assert sum(r["source_loss"][k] * n[k] for k in n) / sum(n.values()) == pytest.approx(r["loss"], rel=1e-6)
    assert history[0]["mix"] == {"pydocs": 0.5, "wordnet": 0.5}
    assert any(r["mix"]["pydocs"] != 0.5 for r in history), "the bandit moved the mixture"
    evals = [r for r in history if "val_loss" in r]
    assert [r["step"] for r in evals] == [4, 8, 12] and all(sorted(r["val_loss_sources"]) == names for r in evals)
    state = json.loads(bandit_reference.with_name("mix.state.json").read_text())
    rows = [sum(r["source_sequences"].get(k, 0) for r in history) for k in names]
    assert state["mixing"]["rows"] == rows and state["mixing"]["updates"] == STEPS
    T = bandit_raw["model"]["seq_len"]
    assert state["tokens_per_source"] == {k: n * T for k, n in zip(names, rows)}
    # the eval JSON: each source's validation loss, equal to training's at the same step, and its tokens
    report = tmp_path / "eval.json"
    assert cli_main(["eval", "--ckpt", str(bandit_reference), "--data", str(two_sources), "--out", str(report),
                     "--engine", "numpy"]) == 0
    got = json.loads(report.read_text())
    assert got["metrics"]["val_loss_sources"] == evals[-1]["val_loss_sources"]
    assert got["tokens_per_source"] == state["tokens_per_source"]


def test_two_fresh_bandit_runs_are_identical(tmp_path, bandit_raw, two_sources, bandit_reference):
    again = tmp_path / "again" / "mix.ckpt"
    assert train(write(tmp_path, bandit_raw), two_sources, again) == 0
    assert again.read_bytes() == bandit_reference.read_bytes()
    assert strip(again.with_name("mix.loss.json")) == strip(bandit_reference.with_name("mix.loss.json"))


def test_sigterm_then_resume_of_a_bandit_run_is_bit_identical(tmp_path, bandit_raw, two_sources, bandit_reference,
                                                             monkeypatch):
    original = Trainer._after_step

    def sigterm_at_step_5(self, phase, step, *rest):
        original(self, phase, step, *rest)
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Trainer, "_after_step", sigterm_at_step_5)
    experiment = write(tmp_path, bandit_raw)
    out = tmp_path / "run" / "mix.ckpt"
    assert train(experiment, two_sources, out) == 0
    assert read_header(out)[0] == 5
    monkeypatch.undo()
    assert train(experiment, two_sources, out, "--resume") == 0
    assert out.read_bytes() == bandit_reference.read_bytes()
    assert strip(out.with_name("mix.loss.json")) == strip(bandit_reference.with_name("mix.loss.json"))
    assert json.loads(out.with_name("mix.state.json").read_text())["mixing"] == \
        json.loads(bandit_reference.with_name("mix.state.json").read_text())["mixing"]


def test_a_resume_from_the_checkpoint_before_the_newest_restores_that_checkpoints_mixing(
        tmp_path, bandit_raw, two_sources, bandit_reference):
    """The state file vouches for the two newest checkpoints; a kill between the renames leaves the older
    checkpoint beside the newer state, and the resume must take the older one's mixing state."""
    experiment = write(tmp_path, bandit_raw)
    out = tmp_path / "run" / "mix.ckpt"
    assert train(experiment, two_sources, out, "--max-steps", "3") == 0
    older = out.read_bytes()
    assert train(experiment, two_sources, out, "--resume", "--max-steps", "6") == 0
    state = json.loads(out.with_name("mix.state.json").read_text())
    assert [c["step"] for c in state["checkpoints"]] == [3, 6]
    assert state["checkpoints"][0]["mixing"] != state["checkpoints"][1]["mixing"]
    out.write_bytes(older)  # the step-3 checkpoint under the step-6 state
    assert train(experiment, two_sources, out, "--resume") == 0
    assert out.read_bytes() == bandit_reference.read_bytes()


def test_a_phase_may_mix_while_another_runs_the_loaders_scheme(tmp_path, tiny_experiment_raw, two_sources):
    raw = {k: v for k, v in tiny_experiment_raw.items() if k not in ("train", "schedule")}
    raw["phases"] = [{"name": "main", "length": {"steps": 4}},
                     {"name": "polish", "length": {"steps": 4}, "loss_on": "assistant",
                      "mixing": {"policy": "fixed", "weights": {"wordnet": 1}}}]
    raw["intervals"] = {"checkpoint": 0, "sample": 0, "eval": 0, "eval_batches": 1}
    out = tmp_path / "run" / "mix.ckpt"
    assert train(write(tmp_path, raw), two_sources, out) == 0
    history = read_loss_history(out.with_name("mix.loss.json"))
    assert all("mix" not in r and "source_loss" in r for r in history[:4])
    assert all(r["mix"] == {"pydocs": 0.0, "wordnet": 1.0} and r["source_sequences"] == {"wordnet": 8}
               for r in history[4:])
    # the loader's scheme draws by tokens: pydocs has more, so it gets most of the first phase's rows
    first = [sum(r["source_sequences"].get(k, 0) for r in history[:4]) for k in ("pydocs", "wordnet")]
    assert first[0] > first[1] and sum(first) == 32


def test_a_mixing_run_whose_source_has_no_validation_window_is_one_sentence(tmp_path, bandit_raw, two_sources, capsys):
    data = tmp_path / "data"
    shutil.copytree(two_sources, data)
    (data / "train.bin.manifest.json").unlink()  # the sources are then the folders found
    (data / "val.bin.manifest.json").unlink()
    tokens = read_shard(data / "wordnet" / "val.bin")
    write_shard(data / "wordnet" / "val.bin", tokens[:10])
    mask = read_mask(mask_path(data / "wordnet" / "val.bin"), tokens.size)
    with mask_writer(mask_path(data / "wordnet" / "val.bin")) as append:
        append(mask[:10])
    assert cli_main(["train", "--experiment", str(write(tmp_path, bandit_raw)), "--data", str(data), "--out",
                     str(tmp_path / "run" / "m.ckpt"), "--engine", "numpy"]) != 0
    err = capsys.readouterr().err
    assert "wordnet" in err and "10 validation tokens" in err and "Traceback" not in err


def test_a_folder_of_sources_without_a_union_trains_and_evaluates(tmp_path, bandit_raw, two_sources):
    """The loader finds the sources by their folders; the state's fingerprint and the eval then name each
    source's shards."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("pydocs", "wordnet", "tokenizer.json"):
        (data / name).symlink_to(two_sources / name)
    raw = dict(bandit_raw, train={"steps": 3})
    out = tmp_path / "run" / "mix.ckpt"
    assert train(write(tmp_path, raw), data, out) == 0
    fingerprint = json.loads(out.with_name("mix.state.json").read_text())["data"]
    assert sorted(k for k in fingerprint if k != "dir") == ["pydocs/train.bin", "pydocs/val.bin",
                                                           "wordnet/train.bin", "wordnet/val.bin"]
    report = tmp_path / "eval.json"
    assert cli_main(["eval", "--ckpt", str(out), "--data", str(data), "--out", str(report), "--engine", "numpy"]) == 0
    val = json.loads(report.read_text())["data"]["val"]
    assert [s["path"] for s in val["shards"]] == [str(data / "pydocs" / "val.bin"), str(data / "wordnet" / "val.bin")]


def test_a_source_drawn_past_its_last_window_starts_a_new_pass(tmp_path):
    """No source runs out: one with a single window gives it at every draw, pass after pass."""
    folder = source_folder(tmp_path, {"alpha": 401, "single": 9})
    mix, windows, exp = mixture(folder, {"policy": "uniform"})
    phase = exp.program(windows.tokens.size).phases[0]
    state = MixState.fresh(2)
    for step in range(5):
        ws, sources = mix.batch(step, mix.probabilities(phase, state), state)
        assert [w for w, k in zip(ws, sources) if k == 1] == [50] * 4  # alpha's 50 windows come first
    assert state.draws == [20, 20]


def strip_mixing(state_path):
    """The state as runs wrote it before mixing existed."""
    state = json.loads(state_path.read_text())
    for entry in [state] + state["checkpoints"]:
        entry.pop("mixing", None)
        entry.pop("tokens_per_source", None)
    state_path.write_text(json.dumps(state))


def test_a_run_from_before_mixing_resumes_with_its_rows_per_source_counted_again(tmp_path, tiny_experiment_raw,
                                                                                 two_sources, capsys):
    raw = dict(tiny_experiment_raw, train={"steps": 8})
    raw["intervals"] = {"checkpoint": 0, "sample": 0, "eval": 0, "eval_batches": 1}
    experiment = write(tmp_path, raw)
    whole, part = tmp_path / "whole" / "mix.ckpt", tmp_path / "part" / "mix.ckpt"
    assert train(experiment, two_sources, whole) == 0
    assert train(experiment, two_sources, part, "--max-steps", "4") == 0
    strip_mixing(part.with_name("mix.state.json"))
    assert train(experiment, two_sources, part, "--resume") == 0
    assert part.read_bytes() == whole.read_bytes()
    done = json.loads(part.with_name("mix.state.json").read_text())
    assert done["tokens_per_source"] == json.loads(whole.with_name("mix.state.json").read_text())["tokens_per_source"]
    # a mixing run cannot be resumed from such a state: its draws and rewards are gone
    mixing = write(tmp_path, dict(raw, mixing={"policy": "bandit"}), "bandit.json")
    run = tmp_path / "bandit" / "mix.ckpt"
    assert train(mixing, two_sources, run, "--max-steps", "4") == 0
    strip_mixing(run.with_name("mix.state.json"))
    capsys.readouterr()
    assert train(mixing, two_sources, run, "--resume") != 0
    assert "holds no mixing state for step 4" in capsys.readouterr().err
