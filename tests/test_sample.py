"""Sampling: ChatML prompts, the stop at <|im_end|>, seeds, and where the CLI finds its inputs."""

import json
from pathlib import Path

import numpy as np
import pytest

from andrea.store.checkpoint import write_checkpoint
from andrea.cli import main as cli
from andrea.spec.config import load_experiment
from andrea.data.chatml import ChatTokenizer
from andrea.engines.numpy_engine import NumpyEngine
from andrea.spec.layout import ParameterLayout
from andrea.schedule.model import init_params
from andrea.tools.sample import Sampler, pick_token, sample, validation_prompts

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "config" / "experiments" / "ANDREA-tiny-TRAIN.json"


@pytest.fixture
def chat(chat_data):
    return ChatTokenizer.load(chat_data / "tokenizer.json")


def favouring(layout, token_id: int) -> np.ndarray:
    """Weights whose logits are 10 for token_id and 0 for every other token, at every position:
    LNf outputs its beta (gamma = 0), and only token_id's embedding row has a component along it."""
    params = np.zeros(layout.n_params, dtype=np.float32)
    layout.view(params, "LNf.beta")[0] = 1.0
    layout.view(params, "wte")[token_id, 0] = 10.0
    return params


def sampler_with(params, chat):
    sampler = Sampler(NumpyEngine(), load_experiment(TINY).model, chat)
    sampler.load_params(params)
    return sampler


def test_generation_stops_at_im_end(chat):
    layout = ParameterLayout(load_experiment(TINY).model)
    sampler = sampler_with(favouring(layout, chat.im_end_id), chat)
    prompt = chat.encode_prompt([{"role": "user", "content": "Hello"}])
    assert sampler.generate(prompt, max_new_tokens=20, temperature=0, top_k=0, rng=np.random.default_rng(0)) == []


def test_generation_runs_to_max_new_tokens_and_slides_past_seq_len(chat):
    layout = ParameterLayout(load_experiment(TINY).model)
    word = chat.encode_text("a")[0]
    sampler = sampler_with(favouring(layout, word), chat)
    prompt = [word] * 60  # the 10 new tokens take the context past T = 64
    out = sampler.generate(prompt, max_new_tokens=10, temperature=0, top_k=0, rng=np.random.default_rng(0))
    assert out == [word] * 10


def test_pick_token():
    probs = np.array([0.1, 0.6, 0.3])
    rng = np.random.default_rng(0)
    assert pick_token(probs, 0.0, 0, rng) == 1
    assert {pick_token(probs, 1.0, 1, rng) for _ in range(20)} == {1}
    assert {pick_token(probs, 1.0, 2, rng) for _ in range(200)} == {1, 2}


def test_validation_prompts_end_with_an_open_assistant_turn(chat, chat_data):
    from andrea.store.shards import read_shard

    prompts = validation_prompts(chat, read_shard(chat_data / "val.bin"), 3)
    opener = [chat.im_start_id] + chat.encode_text("assistant\n")
    assert len(prompts) == 3
    for p in prompts:
        assert p[0] == chat.im_start_id and p[-len(opener):] == opener and chat.endoftext_id not in p
        assert chat.decode(p).endswith("<|im_start|>assistant\n")


@pytest.fixture
def checkpoint(tmp_path, chat_data, tiny_experiment_raw):
    """A tiny checkpoint with a .state.json as `andrea train` writes it (experiment, data folder)."""
    ckpt = tmp_path / "tiny.ckpt"
    layout = ParameterLayout(load_experiment(TINY).model)
    params = init_params(layout, 7)
    zeros = np.zeros_like(params)
    write_checkpoint(ckpt, 12, params, zeros, zeros)
    (tmp_path / "tiny.state.json").write_text(json.dumps({"experiment": tiny_experiment_raw, "data": {"dir": str(chat_data)}}))
    return ckpt


def test_sample_finds_experiment_and_tokenizer_from_state_and_is_seeded(checkpoint):
    kwargs = dict(temperature=1.0, top_k=0, max_new_tokens=12)
    a = sample(checkpoint, "Explain the assert statement.", seed=1, **kwargs)
    assert sample(checkpoint, "Explain the assert statement.", seed=1, **kwargs) == a
    assert sample(checkpoint, "Explain the assert statement.", seed=2, **kwargs)["completion"] != a["completion"]
    assert a["step"] == 12 and a["experiment"] == "ANDREA-tiny"
    assert a["prompt"] == "<|im_start|>user\nExplain the assert statement.<|im_end|>\n<|im_start|>assistant\n"


def test_sample_cli_prints_the_completion(checkpoint, capsys):
    code = cli(["sample", "--ckpt", str(checkpoint), "--prompt", "Hi", "--system", "Be brief.", "--json",
                "--max-new-tokens", "5", "--seed", "3"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")
    assert result["new_tokens"] <= 5


@pytest.mark.parametrize("change, message", [
    ("no_ckpt", "checkpoint not found"),
    ("no_state", "pass --experiment"),
    ("no_tokenizer", "pass --tokenizer"),
    ("long_prompt", "shorten it"),
])
def test_sample_errors_are_one_sentence(checkpoint, capsys, change, message):
    args = ["sample", "--ckpt", str(checkpoint), "--prompt", "Hi"]
    state = checkpoint.with_name("tiny.state.json")
    if change == "no_ckpt":
        args[2] = str(checkpoint.with_name("missing.ckpt"))
    elif change == "no_state":
        state.unlink()
    elif change == "no_tokenizer":
        state.write_text(json.dumps({**json.loads(state.read_text()), "data": {"dir": str(checkpoint.parent)}}))
    else:
        args[-1] = "word " * 100
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_sampler_inside_the_training_models_memory_generates_what_one_of_its_own_does(chat):
    from andrea.spec.memory import device_bytes
    from andrea.schedule.model import Model

    engine = NumpyEngine()
    shape = load_experiment(TINY).model
    trainer = Model(engine, shape, micro_batch=4)
    trainer.load_state(init_params(trainer.layout, 7))
    inside = Sampler(engine, shape, chat, share=trainer)
    own = sampler_with(trainer.host_state()[0], chat)
    assert inside.model.buf["params"] is trainer.buf["params"]
    assert device_bytes(trainer.plan, inside.model.plan) == trainer.plan.total_bytes
    prompt = chat.encode_prompt([{"role": "user", "content": "How do I sort a list?"}])
    for seed in range(3):
        kwargs = dict(max_new_tokens=12, temperature=1.0, top_k=20)
        assert inside.generate(prompt, rng=np.random.default_rng(seed), **kwargs) == \
            own.generate(prompt, rng=np.random.default_rng(seed), **kwargs)
    with pytest.raises(ValueError, match="no such buffer"):
        Sampler(engine, load_experiment(REPO / "config" / "experiments" / "ANDREA-12M-TRAIN.json").model, chat,
                share=trainer)


def fill_transient(model, byte: int = 0xFF) -> None:
    """Overwrite every transient buffer of the model's plan (io, activations, scratch) with `byte`."""
    from andrea.spec.memory import PERSISTENT_ROLES

    e = model.engine
    if e.name == "numpy":
        next(model.buf[b.name].base for b in model.plan.buffers if b.role not in PERSISTENT_ROLES).fill(byte)
    else:
        import cupy

        start, size = e._transient_span(model.buf, model.plan)
        cupy.cuda.runtime.memsetAsync(start.ptr, byte, size, cupy.cuda.get_current_stream().ptr)


@pytest.mark.parametrize("engine, precision", [("numpy", "fp32"), pytest.param("cuda", "fp32", marks=pytest.mark.gpu),
                                               pytest.param("cuda", "bf16", marks=pytest.mark.gpu)])
def test_no_step_reads_what_an_earlier_one_left_in_the_transient_buffers(tmp_path, chat_data, monkeypatch, engine,
                                                                         precision):
    """What lets the sampler run inside the training model's memory: a run whose transient buffers are filled
    with NaN bytes after every step, a run that samples every other step, and a run that never samples
    write the same checkpoint."""
    from andrea.schedule.model import Model

    raw = json.loads(TINY.read_text())
    raw.update(train={"steps": 8}, precision=precision)
    out = {}
    for name, sample_every in (("plain", 0), ("sampling", 2), ("garbage", 0)):
        raw["intervals"] = {"checkpoint": 0, "sample": sample_every, "eval": 3, "eval_batches": 2}
        experiment = tmp_path / f"{name}.json"
        experiment.write_text(json.dumps(raw))
        if name == "garbage":
            original = Model.train_step

            def step_then_garbage(self, *args, **kwargs):
                result = original(self, *args, **kwargs)
                fill_transient(self)
                return result

            monkeypatch.setattr(Model, "train_step", step_then_garbage)
        out[name] = tmp_path / name / "tiny.ckpt"
        assert cli(["train", "--experiment", str(experiment), "--data", str(chat_data), "--out", str(out[name]),
                    "--engine", engine]) == 0
    log = (tmp_path / "sampling" / "tiny.log").read_text()
    assert "inside the training model's memory" in log
    assert json.loads((tmp_path / "sampling" / "tiny.samples.json").read_text())[-1]["step"] == 8
    assert out["sampling"].read_bytes() == out["plain"].read_bytes() == out["garbage"].read_bytes()
