import json

import numpy as np
import pytest

from andrea.spec.config import load_experiment
from andrea.common.errors import AndreaError
from andrea.spec.layout import ParameterLayout, n_params_formula
from conftest import EXPERIMENTS


@pytest.mark.parametrize("name, expected", [("tiny", 135_808), ("12M", 12_396_288), ("120M", 124_392_960),
                                            ("350M", 354_650_112)])
def test_param_count_matches_formula(name, expected):
    exp = load_experiment(EXPERIMENTS / f"ANDREA-{name}-TRAIN.json")
    layout = ParameterLayout(exp.model)
    assert layout.n_params == expected == n_params_formula(exp.model)


def test_layout_tiles_the_flat_vector_in_design_order():
    layout = ParameterLayout(load_experiment(EXPERIMENTS / "ANDREA-tiny-TRAIN.json").model)
    offset = 0
    for t in layout.tensors:
        assert t.offset == offset
        offset = t.end
    assert offset == layout.n_params
    names = [t.name for t in layout.tensors]
    assert names[:4] == ["wte", "wpe", "h0.W_Q", "h0.W_K"]
    assert names[-2:] == ["LNf.gamma", "LNf.beta"]
    flat = np.arange(layout.n_params, dtype=np.float32)
    view = layout.view(flat, "h1.W_1")
    assert view.shape == (64, 256) and view.base is not None
    view[0, 0] = -1
    assert flat[layout["h1.W_1"].offset] == -1


def test_decay_ranges_cover_matrices_only():
    layout = ParameterLayout(load_experiment(EXPERIMENTS / "ANDREA-tiny-TRAIN.json").model)
    mask = np.zeros(layout.n_params, bool)
    for a, b in layout.decay_ranges():
        mask[a:b] = True
    for t in layout.tensors:
        assert mask[t.offset:t.end].all() == (len(t.shape) == 2)
        assert mask[t.offset:t.end].any() == (len(t.shape) == 2)


def _write(tmp_path, raw):
    path = tmp_path / "exp.json"
    path.write_text(json.dumps(raw))
    return path


def test_missing_field_names_file_and_field(tmp_path, tiny_experiment_raw):
    del tiny_experiment_raw["model"]["d_model"]
    path = _write(tmp_path, tiny_experiment_raw)
    with pytest.raises(AndreaError, match=r"exp\.json.*'model'.*d_model"):
        load_experiment(path)


def test_wrong_type_names_field(tmp_path, tiny_experiment_raw):
    tiny_experiment_raw["optimizer"]["lr"] = "fast"
    with pytest.raises(AndreaError, match=r"optimizer\.lr"):
        load_experiment(_write(tmp_path, tiny_experiment_raw))


def test_steps_and_epochs_are_exclusive(tmp_path, tiny_experiment_raw):
    tiny_experiment_raw["train"] = {"steps": 3, "epochs": 1}
    with pytest.raises(AndreaError, match=r"'train'"):
        load_experiment(_write(tmp_path, tiny_experiment_raw))


def test_heads_must_divide_width(tmp_path, tiny_experiment_raw):
    tiny_experiment_raw["model"]["n_head"] = 3
    with pytest.raises(AndreaError, match=r"model\.d_model.*model\.n_head"):
        load_experiment(_write(tmp_path, tiny_experiment_raw))


def test_recompute_layers_name_the_model_s_layers(tmp_path, tiny_experiment_raw):
    n = tiny_experiment_raw["model"]["n_layer"]
    tiny_experiment_raw["recompute"] = ["gelu"]
    tiny_experiment_raw["recompute_layers"] = n
    exp = load_experiment(_write(tmp_path, tiny_experiment_raw))
    assert exp.memory_options == {"recompute": ("gelu",), "recompute_layers": n, "loss_chunks": 1}
    tiny_experiment_raw["recompute_layers"] = n + 1
    with pytest.raises(AndreaError, match=rf"'recompute_layers' \({n + 1}\).*'model\.n_layer' \({n}\)"):
        load_experiment(_write(tmp_path, tiny_experiment_raw))
    tiny_experiment_raw["recompute_layers"] = 0
    with pytest.raises(AndreaError, match=r"recompute_layers"):
        load_experiment(_write(tmp_path, tiny_experiment_raw))


def test_micro_batches_must_divide_batch(tmp_path, tiny_experiment_raw):
    tiny_experiment_raw["batch"]["micro_batches"] = 3
    with pytest.raises(AndreaError, match=r"batch\.batch_size"):
        load_experiment(_write(tmp_path, tiny_experiment_raw))


def test_invalid_json_names_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"name": "x",\n  oops}')
    with pytest.raises(AndreaError, match=r"bad\.json: not valid JSON \(line 2"):
        load_experiment(path)


def test_length_in_epochs(tmp_path, tiny_experiment_raw):
    tiny_experiment_raw["train"] = {"epochs": 2}
    exp = load_experiment(_write(tmp_path, tiny_experiment_raw))
    # 64 * 100 + 1 tokens -> 100 windows of 64; 2 epochs of batch 8 -> 25 steps
    assert exp.total_steps(64 * 100 + 1) == 25


def test_the_schema_lists_the_precision_table():
    from andrea.spec.config import experiment_schema
    from andrea.spec.precision import PRECISIONS

    assert experiment_schema()["properties"]["precision"]["enum"] == list(PRECISIONS)


def test_the_layout_views_w_qkv_as_the_three_projections():
    from andrea.spec.config import ModelShape

    layout = ParameterLayout(ModelShape(n_layer=2, d_model=8, n_head=2, vocab_size=16, seq_len=4))
    flat = np.arange(layout.n_params, dtype=np.float32)
    layer = layout.layer(flat, 1)
    assert layer["W_QKV"].shape == (3, 8, 8)
    for i, name in enumerate(("W_Q", "W_K", "W_V")):
        assert np.shares_memory(layer["W_QKV"][i], flat) and np.array_equal(layer["W_QKV"][i], layer[name])
