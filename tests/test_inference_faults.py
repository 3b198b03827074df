"""A checkpoint that can be read but not used: non-finite weights, a damaged header. Every command
that reads one answers with one sentence, and nothing writes JSON that is not JSON."""

import warnings
from pathlib import Path

import numpy as np
import pytest

from andrea.common.atomic import write_json_atomic
from andrea.store.checkpoint import HEADER, read_header, write_checkpoint
from andrea.cli import main as cli
from andrea.spec.config import load_experiment
from andrea.common.errors import AndreaError
from andrea.spec.layout import ParameterLayout

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "config" / "experiments" / "ANDREA-tiny-TRAIN.json"


@pytest.fixture
def diverged(tmp_path):
    """A tiny checkpoint whose W_1 of layer 1 holds a NaN and an infinity."""
    layout = ParameterLayout(load_experiment(TINY).model)
    params = np.random.default_rng(0).standard_normal(layout.n_params).astype(np.float32) * 0.05
    w1 = layout["h1.W_1"]
    params[w1.offset + 3] = np.nan
    params[w1.offset + 7] = np.inf
    ckpt = tmp_path / "tiny.ckpt"
    write_checkpoint(ckpt, 12, params, np.zeros_like(params), np.zeros_like(params))
    return ckpt, w1.name


@pytest.mark.parametrize("command", ["sample", "eval", "export-hf"])
def test_non_finite_weights_are_one_sentence(tmp_path, capsys, chat_data, diverged, command):
    ckpt, tensor = diverged
    tokenizer = str(chat_data / "tokenizer.json")
    args = {
        "sample": ["sample", "--ckpt", str(ckpt), "--prompt", "Hi", "--experiment", str(TINY), "--tokenizer", tokenizer],
        "eval": ["eval", "--ckpt", str(ckpt), "--data", str(chat_data), "--out", str(tmp_path / "eval.json"),
                 "--experiment", str(TINY)],
        "export-hf": ["export-hf", str(ckpt), str(tmp_path / "hf"), "--experiment", str(TINY), "--tokenizer", tokenizer],
    }[command]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no NaN arithmetic on the way to the refusal
        assert cli(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "2 of its" in err and "NaN or infinite" in err and tensor in err and "earlier checkpoint" in err
    assert not (tmp_path / "eval.json").exists() and not (tmp_path / "hf" / "model.safetensors").exists()


def test_json_is_strict():
    with pytest.raises(ValueError):
        write_json_atomic("/nonexistent/never-written.json", {"loss": float("nan")})


@pytest.mark.parametrize("n_params", [-1610202711, 0])
def test_a_header_with_a_non_positive_n_params_says_so(tmp_path, n_params):
    path = tmp_path / "bad.ckpt"
    path.write_bytes(np.array([(5, n_params)], dtype=HEADER).tobytes() + b"\0" * 16)
    with pytest.raises(AndreaError) as err:
        read_header(path)
    message = str(err.value)
    assert f"n_params={n_params}" in message and "n_params positive" in message
    assert "needs" not in message  # no size arithmetic on a negative count
