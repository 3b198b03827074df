"""`andrea export-hf`: the folder transformers loads gives the NumPy engine's logits and our ChatML."""

import json
from pathlib import Path

import numpy as np
import pytest

from andrea.store.checkpoint import write_checkpoint
from andrea.cli import main as cli
from andrea.spec.config import load_experiment
from andrea.data.chatml import ChatTokenizer, render
from andrea.engines.numpy_engine import NumpyEngine
from andrea.spec.layout import ParameterLayout
from andrea.schedule.model import Model
from andrea.tools.sample import Sampler

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "config" / "experiments" / "ANDREA-tiny-TRAIN.json"
TURNS = [{"role": "system", "content": "You explain Python."}, {"role": "user", "content": "What does zip() do?"}]


def random_params(layout, seed=0) -> np.ndarray:
    """Every tensor non-trivial, LayerNorm gamma/beta included, so a misplaced tensor shows."""
    rng = np.random.default_rng(seed)
    params = np.empty(layout.n_params, dtype=np.float32)
    for t in layout.tensors:
        noise = rng.standard_normal(t.size).astype(np.float32)
        params[t.offset:t.end] = 1 + 0.1 * noise if t.name.endswith("gamma") else 0.1 * noise
    return params


@pytest.fixture(scope="module")
def exported(tmp_path_factory, chat_data):
    root = tmp_path_factory.mktemp("export")
    layout = ParameterLayout(load_experiment(TINY).model)
    params = random_params(layout)
    write_checkpoint(root / "tiny.ckpt", 3, params, np.zeros_like(params), np.zeros_like(params))
    assert cli(["export-hf", str(root / "tiny.ckpt"), str(root / "hf"), "--experiment", str(TINY),
                "--tokenizer", str(chat_data / "tokenizer.json")]) == 0
    return root / "hf", params


def test_folder_holds_safetensors_and_no_pickle(exported):
    from safetensors.numpy import load_file

    folder, params = exported
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "model.safetensors.manifest.json",
                     "tokenizer.json", "tokenizer_config.json"]
    tensors = load_file(folder / "model.safetensors")
    layout = ParameterLayout(load_experiment(TINY).model)
    first = layout.layer(params, 0)
    assert np.array_equal(tensors["transformer.h.0.attn.c_attn.weight"],
                          np.concatenate([first["W_Q"], first["W_K"], first["W_V"]], axis=1))
    assert not tensors["transformer.h.1.mlp.c_fc.bias"].any()
    assert "lm_head.weight" not in tensors  # tied to wte
    assert sum(t.size for name, t in tensors.items() if not name.endswith(("attn.bias", "fc.bias", "proj.bias"))) == layout.n_params
    config = json.loads((folder / "config.json").read_text())
    assert (config["layer_norm_epsilon"], config["activation_function"]) == (1e-5, "gelu_new")


def test_transformers_gives_the_numpy_engines_logits(exported):
    pytest.importorskip("torch", reason="needs torch (CPU): pip install torch==2.13.0")
    pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    import torch
    from transformers import GPT2LMHeadModel

    folder, params = exported
    shape = load_experiment(TINY).model
    tokens = np.random.default_rng(1).integers(0, shape.vocab_size, (2, shape.seq_len)).astype(np.int32)
    model = Model(NumpyEngine(), shape, micro_batch=2, training=False)
    model.load_state(params)
    model.forward(tokens, tokens)
    ours = model.buf["lnf"] @ model.P["wte"].T  # the tied projection loss_fwd starts with

    hf = GPT2LMHeadModel.from_pretrained(folder).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens).long()).logits.numpy()
    relative = np.abs(theirs - ours).max() / np.abs(ours).max()
    print(f"max relative logits error, transformers vs NumPy engine: {relative:.2e}")
    assert relative <= 1e-4
    probs = torch.softmax(torch.from_numpy(theirs), -1).numpy()
    assert np.abs(probs - model.buf["probs"]).max() <= 1e-5


def test_auto_tokenizer_applies_our_chatml(exported, chat_data):
    pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    from transformers import AutoTokenizer

    folder, _ = exported
    tok = AutoTokenizer.from_pretrained(folder)
    chat = ChatTokenizer.load(chat_data / "tokenizer.json")
    text = tok.apply_chat_template(TURNS, tokenize=False, add_generation_prompt=True)
    assert text == render(TURNS) + "<|im_start|>assistant\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == chat.encode_prompt(TURNS)
    assert tok.eos_token == "<|im_end|>"


def test_transformers_greedy_generation_matches_the_sampler(exported, chat_data):
    pytest.importorskip("torch", reason="needs torch (CPU): pip install torch==2.13.0")
    pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    import torch
    from transformers import GPT2LMHeadModel

    folder, params = exported
    chat = ChatTokenizer.load(chat_data / "tokenizer.json")
    prompt = chat.encode_prompt(TURNS)
    sampler = Sampler(NumpyEngine(), load_experiment(TINY).model, chat)
    sampler.load_params(params)
    ours = sampler.generate(prompt, max_new_tokens=8, temperature=0, top_k=0, rng=np.random.default_rng(0))
    hf = GPT2LMHeadModel.from_pretrained(folder).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    theirs = [t for t in out[0, len(prompt):].tolist() if t not in (chat.im_end_id, chat.endoftext_id)]
    assert theirs == ours


@pytest.mark.parametrize("case, message", [
    ("no tokenizer", "pass --tokenizer"),
    ("outdir is a file", "is not a folder"),
])
def test_export_errors_are_one_sentence(tmp_path, capsys, case, message):
    layout = ParameterLayout(load_experiment(TINY).model)
    params = random_params(layout)
    write_checkpoint(tmp_path / "tiny.ckpt", 0, params, params, params)
    out = tmp_path / "hf"
    args = ["export-hf", str(tmp_path / "tiny.ckpt"), str(out), "--experiment", str(TINY)]
    if case == "outdir is a file":
        out.write_text("")
        args += ["--tokenizer", str(tmp_path / "tokenizer.json")]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
