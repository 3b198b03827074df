"""`andrea inspect`: header, the experiment a checkpoint matches, per-tensor statistics, bad files."""

import json
from pathlib import Path

import numpy as np
import pytest

from andrea.store.checkpoint import write_checkpoint
from andrea.common.hashing import sha256_file
from andrea.cli import main as cli
from andrea.spec.config import load_experiment
from andrea.tools.inspect_ckpt import inspect_checkpoint
from andrea.spec.layout import ParameterLayout
from andrea.schedule.model import init_params

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "config" / "experiments"
TINY = EXPERIMENTS / "ANDREA-tiny-TRAIN.json"


@pytest.fixture
def layout():
    return ParameterLayout(load_experiment(TINY).model)


@pytest.fixture
def checkpoint(tmp_path, layout):
    rng = np.random.default_rng(0)
    params = init_params(layout, 3)
    m = rng.standard_normal(layout.n_params).astype(np.float32) * 1e-3
    ckpt = tmp_path / "tiny.ckpt"
    write_checkpoint(ckpt, 17, params, m, m * m)
    return ckpt, params, m


def test_statistics_follow_the_layout(checkpoint, layout):
    ckpt, params, m = checkpoint
    report = inspect_checkpoint(ckpt, experiments_dir=EXPERIMENTS)
    assert (report["step"], report["n_params"], report["state"]) == (17, 135_808, None)
    assert [e["name"] for e in report["matches"]] == ["ANDREA-tiny"]
    assert report["layout_from"] == str(TINY)
    assert [t["name"] for t in report["tensors"]] == [t.name for t in layout.tensors]
    for row, tensor in zip(report["tensors"], layout.tensors):
        for vec, flat in (("weights", params), ("m", m), ("v", m * m)):
            x = flat[tensor.offset:tensor.end].astype(np.float64)
            assert row[vec] == {"mean": pytest.approx(x.mean()), "std": pytest.approx(x.std()),
                                "max_abs": pytest.approx(np.abs(x).max()), "nonfinite": 0}
    assert report["tensors"][layout.tensors.index(layout["h0.LN1.gamma"])]["weights"]["std"] == 0


def test_state_names_the_experiment_and_vouches_for_the_file(checkpoint, tiny_experiment_raw):
    ckpt, _, _ = checkpoint
    exp = load_experiment(TINY)
    ckpt.with_name("tiny.state.json").write_text(json.dumps({
        "experiment": tiny_experiment_raw, "trajectory_hash": exp.trajectory_hash(), "step": 17,
        "checkpoints": [{"step": 17, "sha256": sha256_file(ckpt), "elapsed_s": 1.0}],
    }))
    report = inspect_checkpoint(ckpt, experiments_dir=EXPERIMENTS)
    assert report["state"]["experiment"] == "ANDREA-tiny" and report["state"]["vouches_for_this_file"]
    assert report["matches"][0]["same_trajectory"]


def test_the_state_line_names_the_overrides_the_run_was_trained_with(checkpoint, tiny_experiment_raw, capsys):
    """A run trained with `--set` (the workflow's fp32 preview of a bf16 experiment, say) is not the file as
    written: inspect says so, and the file is no longer the same trajectory."""
    ckpt, _, _ = checkpoint
    raw = {**tiny_experiment_raw, "precision": "tf32"}
    ckpt.with_name("tiny.state.json").write_text(json.dumps({
        "experiment": raw, "overrides": ["precision=tf32"], "trajectory_hash": load_experiment(TINY, ["precision=tf32"])
        .trajectory_hash(), "step": 17, "checkpoints": [{"step": 17, "sha256": sha256_file(ckpt), "elapsed_s": 1.0}],
    }))
    report = inspect_checkpoint(ckpt, experiments_dir=EXPERIMENTS)
    assert report["state"]["overrides"] == ["precision=tf32"] and not report["matches"][0]["same_trajectory"]
    assert cli(["inspect", str(ckpt), "--experiments-dir", str(EXPERIMENTS)]) == 0
    assert "ANDREA-tiny --set precision=tf32, step 17" in capsys.readouterr().out


def test_without_a_matching_experiment_the_whole_vector_is_summarised(checkpoint, tmp_path):
    ckpt, params, _ = checkpoint
    params[5] = np.nan
    write_checkpoint(ckpt, 17, params, params, params)
    report = inspect_checkpoint(ckpt, experiments_dir=tmp_path)
    assert report["matches"] == [] and [t["name"] for t in report["tensors"]] == ["all"]
    assert "pass --experiment" in report["notes"][0]
    weights = report["tensors"][0]["weights"]
    assert weights["nonfinite"] == 1 and np.isfinite(weights["mean"])


def test_cli_prints_header_and_tables(checkpoint, capsys):
    ckpt, _, _ = checkpoint
    assert cli(["inspect", str(ckpt), "--experiments-dir", str(EXPERIMENTS)]) == 0
    out = capsys.readouterr().out
    for text in ("step        17", "n_params    135,808", "ANDREA-tiny", "h1.W_2", "Adam v"):
        assert text in out
    assert cli(["inspect", str(ckpt), "--json", "--experiments-dir", str(EXPERIMENTS)]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 17


@pytest.mark.parametrize("content, message", [
    (None, "checkpoint not found"),
    (b"step,loss\n1,2.5\n", "not a checkpoint"),
    (b"\x01\x00", "too short to be a checkpoint"),
])
def test_a_file_that_is_not_a_checkpoint_is_one_sentence(tmp_path, capsys, content, message):
    path = tmp_path / "file.ckpt"
    if content is not None:
        path.write_bytes(content)
    assert cli(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
