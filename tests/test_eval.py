"""`andrea eval` against a real training run: the same numbers the loop logged, bits per byte, errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from andrea.store.checkpoint import read_checkpoint, write_checkpoint
from andrea.cli import main as cli
from andrea.spec.config import load_experiment
from andrea.engines.numpy_engine import NumpyEngine
from andrea.tools.evaluate import (evaluate_checkpoint, evaluated_targets, source_validation_losses, validation_loss,
                                   validation_losses)
from andrea.tools.inference import load_tokenizer
from andrea.spec.layout import ParameterLayout
from andrea.store.loader import TokenWindows
from andrea.store.manifest import manifest_path, read_manifest
from andrea.schedule.model import Model, init_params
from andrea.tools.sample import Sampler, training_samples, validation_prompts
from andrea.store.shards import mask_path, mask_writer, write_shard
from andrea.store.runfiles import read_loss_history
from andrea.run.train import N_SAMPLE_PROMPTS

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "config" / "experiments" / "ANDREA-tiny-TRAIN.json"
STEPS = 20  # a multiple of ANDREA-tiny's eval and sample intervals: both are logged at this step


@pytest.fixture(scope="module")
def run(tmp_path_factory, chat_data):
    out = tmp_path_factory.mktemp("run") / "tiny.ckpt"
    cmd = [sys.executable, "-m", "andrea.cli", "train", "--experiment", str(TINY), "--data", str(chat_data),
           "--out", str(out), "--engine", "numpy", "--max-steps", str(STEPS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def test_eval_equals_the_val_loss_training_logged(run, chat_data, tmp_path):
    logged = read_loss_history(run.with_name("tiny.loss.json"))[-1]
    assert logged["step"] == STEPS and "val_loss" in logged
    out = tmp_path / "eval" / "tiny.json"
    assert cli(["eval", "--experiment", str(TINY), "--ckpt", str(run), "--data", str(chat_data), "--out", str(out),
                "--engine", "numpy"]) == 0
    report = json.loads(out.read_text())
    metrics = report["metrics"]
    assert metrics["val_loss"] == logged["val_loss"]
    assert metrics["perplexity"] == pytest.approx(math.exp(logged["val_loss"]), rel=1e-12)
    exp = load_experiment(TINY)
    assert metrics["tokens"] == exp.intervals["eval_batches"] * exp.micro_batch_size * exp.model.seq_len
    assert report["checkpoint"]["step"] == STEPS and report["checkpoint"]["vouched_for_by_state"] is True
    assert report["data"]["val"]["sha256"] == read_manifest(chat_data / "val.bin")["sha256"]
    assert report["lineage"]["status"] == "ok" and report["lineage"]["stage"] == "tokenize"
    assert read_manifest(out)["stage"] == "eval" and manifest_path(out).is_file()


def test_bits_per_byte_counts_the_decoded_target_text(run, chat_data):
    report = evaluate_checkpoint(None, run, chat_data, engine="numpy")
    metrics = report["metrics"]
    T = metrics["seq_len"]
    windows = TokenWindows(chat_data / "val.bin", T)
    pieces = evaluated_targets(windows, metrics["micro_batch"], metrics["batches"])
    # the scored windows, evenly spaced over the split: each piece is one window's targets (none are adjacent here)
    W, n = windows.n_windows, metrics["distinct_windows"]
    starts = [(2 * j + 1) * W // (2 * n) * T for j in range(n)]
    assert len(pieces) == n == metrics["batches"] * metrics["micro_batch"] < W
    assert all(np.array_equal(p, windows.tokens[s + 1: s + T + 1]) for p, s in zip(pieces, starts))
    assert metrics["tokens"] == sum(p.size for p in pieces) == n * T
    chat = load_tokenizer(chat_data / "tokenizer.json")
    assert metrics["bytes"] == sum(len(chat.decode(p).encode("utf-8")) for p in pieces) > metrics["tokens"]
    assert metrics["bits_per_byte"] == pytest.approx(
        metrics["val_loss"] * metrics["tokens"] / math.log(2) / metrics["bytes"], rel=1e-12)

    again = evaluate_checkpoint(None, run, chat_data, engine="numpy")
    assert {k: v for k, v in again.items() if k != "throughput"} == {k: v for k, v in report.items() if k != "throughput"}


def test_without_a_tokenizer_bits_per_byte_is_null(tmp_path, repetitive_data):
    layout = ParameterLayout(load_experiment(TINY).model)
    params = init_params(layout, 0)
    write_checkpoint(tmp_path / "tiny.ckpt", 0, params, params, params)
    report = evaluate_checkpoint(TINY, tmp_path / "tiny.ckpt", repetitive_data, engine="numpy")
    assert report["metrics"]["bits_per_byte"] is None and report["data"]["tokenizer"] is None
    assert report["lineage"] is None and report["trained_on"] is None
    assert report["metrics"]["val_loss"] == pytest.approx(math.log(512), rel=0.01)  # untrained: uniform


def test_samples_json_is_what_the_sample_code_gives(run, chat_data):
    exp = load_experiment(TINY)
    logged = json.loads(run.with_name("tiny.samples.json").read_text())[-1]
    step, params, _, _ = read_checkpoint(run)
    assert logged["step"] == step == STEPS
    chat = load_tokenizer(chat_data / "tokenizer.json")
    sampler = Sampler(NumpyEngine(), exp.model, chat)
    sampler.load_params(params)
    prompts = validation_prompts(chat, TokenWindows(chat_data / "val.bin", 64).tokens, N_SAMPLE_PROMPTS)
    assert training_samples(sampler, prompts, seed=exp.seed, step=step) == logged["samples"]


def test_batches_all_scores_every_window_once(run, chat_data, tmp_path):
    exp = load_experiment(TINY)
    B, T = exp.micro_batch_size, exp.model.seq_len
    windows = TokenWindows(chat_data / "val.bin", T)
    W = windows.n_windows
    assert W % B, "a last micro-batch with fewer windows than B"
    out = tmp_path / "all.json"
    assert cli(["eval", "--experiment", str(TINY), "--ckpt", str(run), "--data", str(chat_data), "--out", str(out),
                "--engine", "numpy", "--batches", "all"]) == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["distinct_windows"] == W and metrics["batches"] == -(-W // B) and metrics["tokens"] == W * T
    # every window once, adjacent in one source: one piece, the val shard's targets 1 .. W·T
    pieces = evaluated_targets(windows, B, metrics["batches"])
    assert len(pieces) == 1 and np.array_equal(pieces[0], windows.tokens[1: W * T + 1])
    chat = load_tokenizer(chat_data / "tokenizer.json")
    assert metrics["bytes"] == len(chat.decode(pieces[0]).encode("utf-8"))

    # the loss is the mean over every target of the split, the last micro-batch's padding adding nothing
    step, params, _, _ = read_checkpoint(run)
    one = Model(NumpyEngine(), exp.model, 1, training=False)
    one.load_state(params)
    per_window = [one.forward(*windows.micro_batches_of([w], 1)[0]) for w in range(W)]
    assert metrics["val_loss"] == pytest.approx(float(np.mean(per_window)), rel=1e-5)


def test_batches_beyond_the_split_are_refused(run, chat_data, tmp_path, capsys):
    exp = load_experiment(TINY)
    W = TokenWindows(chat_data / "val.bin", exp.model.seq_len).n_windows
    too_many = W // exp.micro_batch_size + 1
    code = cli(["eval", "--experiment", str(TINY), "--ckpt", str(run), "--data", str(chat_data),
                "--out", str(tmp_path / "eval.json"), "--engine", "numpy", "--batches", str(too_many)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"--batches {too_many}" in err and f"has {W:,}" in err and "--batches all" in err
    assert not (tmp_path / "eval.json").exists()


@pytest.fixture
def two_sources_val(tmp_path, chat_data):
    """A val split of two sources the trained model scores far apart: alpha, text like its training data (the chat
    val shard's tokens), and beta, ids drawn uniformly; masks mark every other target."""
    rng = np.random.default_rng(5)
    tokens = {"alpha": np.asarray(TokenWindows(chat_data / "val.bin", 64).tokens[:3_000]),
              "beta": rng.integers(0, 512, 1_000)}
    masks = {name: rng.integers(0, 2, t.size) for name, t in tokens.items()}
    for name, t in tokens.items():
        (tmp_path / name).mkdir()
        write_shard(tmp_path / name / "val.bin", t)
        with mask_writer(mask_path(tmp_path / name / "val.bin")) as append:
            append(masks[name])
    return tmp_path / "val.bin", tokens, masks


def per_position_losses(model, tokens: np.ndarray, T: int, start: int) -> np.ndarray:
    """The cross-entropy of each target of the window at `start`, by a model of micro-batch 1."""
    model.forward(tokens[None, start: start + T], tokens[None, start + 1: start + T + 1])
    return model.buf["losses"].reshape(-1).copy()


def test_headline_validation_covers_every_source_by_its_windows(run, two_sources_val):
    """The validation windows are n = min(batches x B, W) of the split's W, window (2j + 1)W // 2n for j < n: distinct
    and spread over every source by its share; the loss is the mean over their targets (sum(w ce) / sum(w) with the
    masks), each source's loss the same over its own windows."""
    path, tokens, masks = two_sources_val
    exp = load_experiment(TINY)
    T, B, n_batches = exp.model.seq_len, exp.micro_batch_size, 4
    windows = TokenWindows(path, T)
    per_source = [(t.size - 1) // T for t in tokens.values()]
    assert windows.sources == ["alpha", "beta"] and windows.n_windows == sum(per_source) == 61
    _, params, _, _ = read_checkpoint(run)
    model = Model(NumpyEngine("float64"), exp.model, B, training=False)
    one = Model(NumpyEngine("float64"), exp.model, 1, training=False)
    model.load_state(params)
    one.load_state(params)

    def expected(chosen, assistant=False):
        """The definition, window by window: chosen = [(source, window within it)]."""
        total, counted = 0.0, 0.0
        for name, w in chosen:
            ce = per_position_losses(one, tokens[name].astype(np.int32), T, w * T)
            weights = masks[name][w * T + 1: w * T + T + 1] if assistant else np.ones(T)
            total += float(np.sum(weights * ce))
            counted += float(weights.sum())
        return total / counted

    def spread(W, n):
        return [(2 * j + 1) * W // (2 * n) for j in range(min(n, W))]

    W = windows.n_windows
    union = [("alpha", w) if w < per_source[0] else ("beta", w - per_source[0]) for w in spread(W, n_batches * B)]
    assert len(set(union)) == n_batches * B and sum(name == "beta" for name, _ in union) == 4  # 16 x 15/61 ≈ 4
    headline = validation_loss(model, windows, n_batches)
    assert headline == pytest.approx(expected(union), rel=1e-9)
    first_source_only = expected([("alpha", w) for w in range(n_batches * B)])  # the split's first windows
    assert abs(headline - first_source_only) > 0.1
    forwards = []
    model.forward = lambda *a, _forward=model.forward, **k: forwards.append(1) or _forward(*a, **k)
    both = validation_losses(model, windows, n_batches, assistant=True)
    assert both["val_loss"] == headline and len(forwards) == n_batches  # one forward a micro-batch for both
    assert both["val_loss_assistant"] == pytest.approx(expected(union, True), rel=1e-9)
    del model.forward

    # each source over its own windows: beta's 15 are fewer than 4 x 4, so all of them once (a padded micro-batch)
    got = source_validation_losses(model, windows, n_batches)
    alpha = [("alpha", w) for w in spread(per_source[0], n_batches * B)]
    assert got["alpha"] == pytest.approx(expected(alpha), rel=1e-9)
    assert got["beta"] == pytest.approx(expected([("beta", w) for w in range(per_source[1])]), rel=1e-9)
    assert abs(got["alpha"] - got["beta"]) > 0.5

    # every window once: one piece of text a source, never joined across the sources
    pieces = evaluated_targets(windows, B, -(-W // B))
    assert [p.size for p in pieces] == [k * T for k in per_source]
    assert all(np.array_equal(p, t[1: p.size + 1]) for p, t in zip(pieces, tokens.values()))


@pytest.mark.parametrize("case, message", [
    ("missing checkpoint", "checkpoint not found"),
    ("not a checkpoint", "not a checkpoint"),
    ("missing data", "token shard not found"),
    ("empty validation shard", "0 tokens is fewer than one sequence"),
    ("another experiment's checkpoint", "it is a checkpoint of another model (matching: "),
    ("same size, other shape", "pass the experiment it was trained with"),
    ("missing experiment", "experiment file not found"),
])
def test_bad_inputs_are_one_sentence(run, chat_data, tmp_path, capsys, case, message):
    ckpt, data, experiment = run, chat_data, TINY
    if case == "missing checkpoint":
        ckpt = tmp_path / "none.ckpt"
    elif case == "not a checkpoint":
        ckpt = tmp_path / "notes.ckpt"
        ckpt.write_text("not weights\n")
    elif case == "missing data":
        data = tmp_path / "no-data"
    elif case == "empty validation shard":
        data = tmp_path
        write_shard(data / "val.bin", np.array([], dtype=np.uint16))
    elif case == "another experiment's checkpoint":
        experiment = REPO / "config" / "experiments" / "ANDREA-12M-TRAIN.json"
    elif case == "same size, other shape":
        raw = json.loads(TINY.read_text())
        raw["model"]["n_head"] = 8  # the same parameters, other attention heads
        experiment = tmp_path / "tiny-8-heads.json"
        experiment.write_text(json.dumps(raw))
    else:
        experiment = tmp_path / "none.json"
    code = cli(["eval", "--experiment", str(experiment), "--ckpt", str(ckpt), "--data", str(data),
                "--out", str(tmp_path / "eval.json"), "--engine", "numpy"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("andrea eval: error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "eval.json").exists()
