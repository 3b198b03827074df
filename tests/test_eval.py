"""`andrea eval` against a real training run: the same numbers the loop logged, bits per byte, errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from andrea.checkpoint import read_checkpoint, write_checkpoint
from andrea.cli import main as cli
from andrea.config import load_experiment
from andrea.engines.numpy_engine import NumpyEngine
from andrea.evaluate import evaluate_checkpoint, evaluated_targets
from andrea.inference import load_tokenizer
from andrea.layout import ParameterLayout
from andrea.loader import TokenWindows
from andrea.manifest import manifest_path, read_manifest
from andrea.model import init_params
from andrea.sample import Sampler, training_samples, validation_prompts
from andrea.shards import write_shard
from andrea.runfiles import read_loss_history
from andrea.train import N_SAMPLE_PROMPTS

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
    windows = TokenWindows(chat_data / "val.bin", 64)
    targets = evaluated_targets(windows, metrics["micro_batch"], metrics["batches"])
    # consecutive validation windows are consecutive text: the targets are tokens 1 .. n of the shard
    assert np.array_equal(targets, windows.tokens[1:metrics["tokens"] + 1])
    text = load_tokenizer(chat_data / "tokenizer.json").decode(targets)
    assert metrics["bytes"] == len(text.encode("utf-8")) > metrics["tokens"]
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
