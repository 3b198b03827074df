"""The memory plan: dtypes per role under mixed precision, what recomputation saves, and that
recomputing activations in the backward changes no bit of training (NumPy engine)."""

import hashlib

import numpy as np
import pytest

from andrea.spec.config import ModelShape, load_experiment
from andrea.schedule.crosscheck import train_run
from andrea.engines.numpy_engine import NumpyEngine
from andrea.spec.layout import ParameterLayout
from andrea.spec.memory import plan_model
from conftest import EXPERIMENTS

SHAPE_120M = ModelShape(n_layer=12, d_model=768, n_head=12, vocab_size=50304, seq_len=1024)
SHAPE_12M = ModelShape(n_layer=6, d_model=384, n_head=6, vocab_size=4096, seq_len=512)
TINY = ModelShape(n_layer=2, d_model=32, n_head=4, vocab_size=97, seq_len=16)
GIB = 2**30


def _by_name(plan):
    return {b.name: b for b in plan.buffers}


def test_mixed_precision_keeps_fp32_state_and_statistics():
    plan = _by_name(plan_model(ParameterLayout(TINY), 2, attention="lse", act_dtype="bfloat16"))
    for name in ("params", "grads", "m", "v", "ln1_mean", "ln1_rstd", "att", "losses", "loss_weights", "d_residual",
                 "d_att"):
        assert plan[name].dtype == "float32", name
    for name in ("params_lp", "residual", "qkv", "atty", "mlp_pre", "mlp_act", "probs", "d_qkv", "d_branch", "d_ln"):
        assert plan[name].dtype == "bfloat16", name
    assert plan["params_lp"].shape == plan["params"].shape
    assert plan["params_lp"].nbytes * 2 == plan["params"].nbytes
    assert "d_logits" not in plan  # the classifier's gradient is made in probs, in place


def test_fp32_plan_has_no_low_precision_copy():
    plan = _by_name(plan_model(ParameterLayout(TINY), 2))
    assert "params_lp" not in plan
    assert {b.dtype for b in plan.values()} <= {"float32", "int32"}


@pytest.mark.parametrize("recompute", [("gelu",), ("layernorm",), ("gelu", "layernorm")])
def test_recompute_keeps_one_layer(recompute):
    layout = ParameterLayout(SHAPE_12M)
    full = _by_name(plan_model(layout, 32, attention="lse", act_dtype="bfloat16"))
    less = _by_name(plan_model(layout, 32, attention="lse", act_dtype="bfloat16", recompute=recompute))
    if "gelu" in recompute:  # both rebuilt by the up-projection again
        assert "mlp_act" not in less and "mlp_pre" not in less
        assert less["mlp_act_layer"].shape == full["mlp_act"].shape[1:]
        assert less["mlp_pre_layer"].shape == full["mlp_pre"].shape[1:]
    if "layernorm" in recompute:  # one buffer for the LayerNorm output in use
        assert "ln1" not in less and "ln2" not in less
        assert less["ln"].shape == full["ln1"].shape[1:] == full["ln2"].shape[1:]
    assert ("d_mlp_pre" in less) == ("gelu" not in recompute)


@pytest.mark.parametrize("r", [1, 4, 5])
def test_the_first_recompute_layers_recompute_and_the_others_keep_theirs(r):
    """recompute_layers r of 6: the kept activations hold 6 - r layers, one layer's buffers serve the r that
    recompute, and the plan lies between recomputing in every layer and in none."""
    from andrea.spec.memory import layer_buffer

    layout, kw = ParameterLayout(SHAPE_12M), dict(attention="lse", act_dtype="bfloat16")
    every, none = (plan_model(layout, 32, recompute=rc, **kw) for rc in (("gelu", "layernorm"), ()))
    some = plan_model(layout, 32, recompute=("gelu", "layernorm"), recompute_layers=r, **kw)
    by = _by_name(some)
    L = SHAPE_12M.n_layer
    for name in ("ln1", "ln2", "mlp_pre", "mlp_act"):
        assert by[name].shape[0] == L - r
    for name in ("ln", "mlp_pre_layer", "mlp_act_layer"):
        assert name in by
    assert every.total_bytes < some.total_bytes < none.total_bytes
    buf = {"ln1": list(range(L - r)), "ln": "ln", "mlp_act": list(range(L))}
    assert [layer_buffer(buf, "ln1", l, ("layernorm",), r) for l in range(L)] == ["ln"] * r + list(range(L - r))
    assert [layer_buffer(buf, "mlp_act", l, ("layernorm",), r) for l in range(L)] == list(range(L))  # gelu not named
    with pytest.raises(ValueError, match="recompute_layers 7"):
        plan_model(layout, 32, recompute=("gelu",), recompute_layers=7, **kw)


def test_the_trainer_recomputes_on_the_cuda_engine_only():
    from andrea.run.train import model_options

    exp = load_experiment(EXPERIMENTS / "ANDREA-12M-TRAIN.json")
    assert exp.recompute and model_options(exp, "cuda") == exp.memory_options
    assert model_options(exp, "numpy") == {**exp.memory_options, "recompute": ()}
    chunked = load_experiment(EXPERIMENTS / "ANDREA-120M-TRAIN.json")
    assert model_options(chunked, "numpy")["loss_chunks"] == chunked.loss_chunks == 2  # part of the trajectory


def test_bf16_plans_fit_the_peer_and_the_seed_figure():
    """120M at B 8 under the PyTorch bf16 + torch.compile peak (5.1 GiB); 12M at B 32 within the seed's 1.4 GB
    (the CUDA engine's own buffers included: cuBLAS workspace, decay ranges, LayerNorm partial sums; and the
    training model's [C, 3C] copy of W_QKV), with the experiments' own memory options."""
    from andrea import ops
    from andrea.engines.cuda_engine import CUBLAS_WORKSPACE_BYTES
    from andrea.ops import attn_qkv, fp8
    from andrea.ops.loss import LOSS_SLOTS

    own = CUBLAS_WORKSPACE_BYTES + sum(b.nbytes for b in ops.engine_buffers())
    # decay ranges, LayerNorm partials, the FP8 scales, the embedding backward's sorted keys, a step's loss sums
    assert own == (CUBLAS_WORKSPACE_BYTES + 2 * 1024 * 8 + 2 * 128 * 4096 * 4 + fp8.SLOT_FLOATS * fp8.SCALE_SLOTS * 4
                   + 2 * 4 * 32768 + 2 * 8 * LOSS_SLOTS)
    big_exp, small_exp = (load_experiment(EXPERIMENTS / f"ANDREA-{n}-TRAIN.json") for n in ("120M", "12M"))
    assert (big_exp.model, small_exp.model) == (SHAPE_120M, SHAPE_12M)
    big, small = (plan_model(ParameterLayout(exp.model), B, attention="lse", act_dtype="bfloat16",
                             recompute=exp.recompute, recompute_layers=exp.recompute_layers, loss_chunks=exp.loss_chunks,
                             engine_buffers=attn_qkv.plan_buffers(exp.model.d_model, exp.model.n_layer, "bfloat16"))
                  for exp, B in ((big_exp, 8), (small_exp, 32)))
    assert big.total_bytes + own <= 5.1 * GIB
    assert small.total_bytes + own <= 1.4e9


@pytest.mark.parametrize("recompute, layers", [(("gelu",), None), (("layernorm",), None), (("gelu", "layernorm"), None),
                                               (("gelu", "layernorm"), 1)])
def test_recompute_gives_the_same_bits_on_numpy(recompute, layers):
    plain = train_run(NumpyEngine(), TINY, micro_batch=2, n_micro=2, steps=3)
    again = train_run(NumpyEngine(), TINY, micro_batch=2, n_micro=2, steps=3, recompute=recompute,
                      recompute_layers=layers)
    assert plain.digest == again.digest
    assert np.isfinite(plain.losses).all()


@pytest.mark.parametrize("B, chunks, rows", [(4, 2, 2), (3, 2, 2), (5, 4, 2), (2, 8, 1)])
def test_loss_chunks_size_probs_for_one_piece(B, chunks, rows):
    one = _by_name(plan_model(ParameterLayout(TINY), B, loss_chunks=1))
    split = _by_name(plan_model(ParameterLayout(TINY), B, loss_chunks=chunks))
    assert one["probs"].shape == (B, TINY.seq_len, TINY.vocab_size)
    assert split["probs"].shape == (rows, TINY.seq_len, TINY.vocab_size)
    assert split["losses"].shape == one["losses"].shape == (B, TINY.seq_len)


@pytest.mark.parametrize("B", [2, 3])
def test_loss_chunks_train_the_same_model_on_numpy(B):
    """Pieces of the classifier: the same losses and weights up to the sum order of wte's gradient."""
    whole = train_run(NumpyEngine("float64"), TINY, micro_batch=B, n_micro=2, steps=3)
    pieces = train_run(NumpyEngine("float64"), TINY, micro_batch=B, n_micro=2, steps=3, loss_chunks=2)
    np.testing.assert_allclose(pieces.losses, whole.losses, rtol=1e-12)
    np.testing.assert_allclose(pieces.params, whole.params, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("training", [True, False])
def test_every_plan_holds_the_loss_weights_of_a_micro_batch(training):
    """Training on a loss mask and evaluating on one both upload a micro-batch's weights, aligned with its targets."""
    plan = _by_name(plan_model(ParameterLayout(TINY), 3, training=training, act_dtype="bfloat16", loss_chunks=2))
    w = plan["loss_weights"]
    assert (w.shape, w.dtype, w.role) == (plan["targets"].shape, "float32", "io")


def test_training_plan_without_training_ignores_recompute():
    layout = ParameterLayout(TINY)
    a = plan_model(layout, 2, training=False, recompute=("gelu", "layernorm"))
    b = plan_model(layout, 2, training=False)
    assert hashlib.sha256(repr(a.buffers).encode()).digest() == hashlib.sha256(repr(b.buffers).encode()).digest()


def test_fp8_plans_add_the_weight_copies_and_count_the_engine_scratch_once_at_its_largest():
    """Under fp8 a plan adds params_fp8 (kept, so a sampler sharing the weights shares it: 2 bytes a layer
    weight and a wte element, 256-byte aligned, plus the casts' table and the scale slots) and the engine's fp8_operands, which two
    models on one engine (the trainer at B 8, its sampler at B 1) count once, at the larger size the engine
    holds; a training plan also the E5M2 d_logits of a classifier piece (fp8_dlogits), a sampler's none."""
    from andrea.spec.memory import device_bytes
    from andrea.ops import fp8

    layout = ParameterLayout(SHAPE_120M)
    C, L, T, V = SHAPE_120M.d_model, SHAPE_120M.n_layer, SHAPE_120M.seq_len, SHAPE_120M.vocab_size

    def plan(B, training=True):
        return plan_model(layout, B, training=training, attention="lse", act_dtype="bfloat16", loss_chunks=2,
                          engine_buffers=fp8.plan_buffers(B, T, C, L, V, B // 2 * T if training else None))

    trainer, sampler = plan(8), plan(1, training=False)
    by_name = {b.name: b for b in trainer.buffers}
    # W_O has none: attn_out stays bf16 under fp8
    weights = sum(t.size for t in layout.tensors if t.name.split(".")[-1] in {"W_Q", "W_K", "W_V", "W_1", "W_2"})
    weights += V * C
    assert by_name["params_fp8"].role == "parameters"
    # the copies, 256-byte aligned, then a row of the casts' table (16 int64) and a scale slot (16 bytes) a matrix
    assert 2 * weights <= by_name["params_fp8"].nbytes <= 2 * weights + 8 * 256 * (L + 1) + (128 + 16) * (3 * L + 1)
    assert by_name["fp8_dlogits"].nbytes == by_name["probs"].nbytes // 2 == 4 * T * V
    assert "fp8_dlogits" not in {b.name for b in sampler.buffers}
    big, small = by_name["fp8_operands"].nbytes, {b.name: b for b in sampler.buffers}["fp8_operands"].nbytes
    assert small < big
    alone = sum(b.nbytes for b in trainer.buffers) + sum(b.nbytes for b in sampler.buffers if b.role != "engine")
    assert device_bytes(trainer, sampler) == alone
    assert device_bytes(sampler, trainer) == alone  # the order does not matter
