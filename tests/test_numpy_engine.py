"""Finite-difference gradient checks (float64) for every op pair (the loss weighted too), `+=` semantics, the
whole model."""

import zlib

import numpy as np
import pytest

from andrea.spec.config import load_experiment
from andrea.schedule.crosscheck import train_run
from andrea.engines.numpy_engine import NumpyEngine
from andrea.schedule.model import Model, init_params
from conftest import EXPERIMENTS

B, T, C, H, V = 2, 5, 8, 2, 11
E = NumpyEngine("float64")


def rand(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


# Each op fixture returns (differentiable inputs, fwd, bwd) on fresh random float64 inputs;
# the checked scalar is L = sum(out * R) for a random R, so dout = R.


def op_embed(rng):
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    tokens[0, :2] = 3  # a repeated id must accumulate, not overwrite
    x = {"wte": rand(rng, V, C), "wpe": rand(rng, T + 2, C)}

    def fwd(x):
        out = np.zeros((B, T, C))
        E.embed_fwd(out, tokens, x["wte"], x["wpe"])
        return out, None

    def bwd(x, saved, dout, g):
        E.embed_bwd(g["wte"], g["wpe"], dout, tokens)

    return x, fwd, bwd


def op_layernorm(rng):
    x = {"inp": rand(rng, B, T, C) * 3 + 1, "gamma": rand(rng, C), "beta": rand(rng, C)}

    def fwd(x):
        out, mean, rstd = np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T))
        E.layernorm_fwd(out, mean, rstd, x["inp"], x["gamma"], x["beta"])
        return out, (mean, rstd)

    def bwd(x, saved, dout, g):
        E.layernorm_bwd(g["inp"], g["gamma"], g["beta"], dout, x["inp"], x["gamma"], *saved)

    return x, fwd, bwd


def op_attn_qkv(rng):
    x = {"inp": rand(rng, B, T, C), "W_QKV": rand(rng, 3, C, C)}

    def fwd(x):
        out = np.zeros((3, B, T, C))
        E.attn_qkv_fwd(out, x["inp"], x["W_QKV"])
        return out, None

    def bwd(x, saved, dout, g):
        E.attn_qkv_bwd(g["inp"], g["W_QKV"], dout, x["inp"], x["W_QKV"])

    return x, fwd, bwd


def op_attn(rng):
    x = {"qkv": rand(rng, 3, B, T, C)}

    def fwd(x):
        out, att = np.zeros((B, T, C)), np.zeros((B, H, T, T))
        E.attn_fwd(out, att, x["qkv"], H)
        return out, (out, att)

    def bwd(x, saved, dout, g):
        E.attn_bwd(g["qkv"], np.zeros((B, H, T, T)), dout, x["qkv"], *saved, H)

    return x, fwd, bwd


def op_attn_out(rng):
    x = {"inp": rand(rng, B, T, C), "W_O": rand(rng, C, C)}

    def fwd(x):
        out = np.zeros((B, T, C))
        E.attn_out_fwd(out, x["inp"], x["W_O"])
        return out, None

    def bwd(x, saved, dout, g):
        E.attn_out_bwd(g["inp"], g["W_O"], dout, x["inp"], x["W_O"])

    return x, fwd, bwd


def op_mlp(rng):
    x = {"inp": rand(rng, B, T, C), "W_1": rand(rng, C, 4 * C), "W_2": rand(rng, 4 * C, C, scale=0.5)}

    def fwd(x):
        out, pre, act = np.zeros((B, T, C)), np.zeros((B, T, 4 * C)), np.zeros((B, T, 4 * C))
        E.mlp_fwd(out, pre, act, x["inp"], x["W_1"], x["W_2"])
        return out, (pre, act)

    def bwd(x, saved, dout, g):
        E.mlp_bwd(g["inp"], g["W_1"], g["W_2"], np.zeros((B, T, 4 * C)), dout, x["inp"], *saved, x["W_1"], x["W_2"])

    return x, fwd, bwd


def op_residual_add(rng):
    x = {"a": rand(rng, B, T, C), "b": rand(rng, B, T, C)}

    def fwd(x):
        out = np.zeros((B, T, C))
        E.residual_add(out, x["a"], x["b"])
        return out, None

    def bwd(x, saved, dout, g):
        E.residual_add_bwd(g["a"], g["b"], dout)

    return x, fwd, bwd


OPS = [op_embed, op_layernorm, op_attn_qkv, op_attn, op_attn_out, op_mlp, op_residual_add]


def analytic_and_numeric(op, seed, n_probe=12, h=1e-6):
    rng = np.random.default_rng(seed)
    x, fwd, bwd = op(rng)
    out, saved = fwd(x)
    R = rng.standard_normal(out.shape)
    grads = {k: np.zeros_like(v) for k, v in x.items()}
    bwd(x, saved, R, grads)
    pairs = []
    for name, arr in x.items():
        for i in rng.choice(arr.size, min(n_probe, arr.size), replace=False):
            orig = arr.flat[i]
            arr.flat[i] = orig + h
            lp = np.sum(fwd(x)[0] * R)
            arr.flat[i] = orig - h
            lm = np.sum(fwd(x)[0] * R)
            arr.flat[i] = orig
            pairs.append((name, grads[name].flat[i], (lp - lm) / (2 * h)))
    return x, fwd, bwd, R, grads, pairs


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__[3:])
def test_op_gradient_matches_finite_difference(op):
    *_, pairs = analytic_and_numeric(op, seed=zlib.crc32(op.__name__.encode()))  # str hash() varies by process
    for name, analytic, numeric in pairs:
        assert analytic == pytest.approx(numeric, rel=1e-6, abs=1e-8), name


@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__[3:])
def test_backward_adds_into_gradients(op):
    x, fwd, bwd, R, grads, _ = analytic_and_numeric(op, seed=7, n_probe=1)
    once = {k: v.copy() for k, v in grads.items()}
    assert any(np.abs(v).max() > 0 for v in once.values())
    _, saved = fwd(x)
    bwd(x, saved, R, grads)
    for k in grads:
        np.testing.assert_allclose(grads[k], 2 * once[k], rtol=1e-12, atol=1e-14)


def test_layernorm_residual_bwd_is_the_gradient_at_both_inputs_of_the_residual():
    """x = a + b feeds the LayerNorm and the residual stream past it: L = sum(LN(x) * R) + sum(x * S). With
    dinp = S on entry (the stream's gradient from above), the fused backward leaves dL/da in dinp and writes
    dL/db (the same) into dbranch, overwriting it."""
    rng = np.random.default_rng(11)
    a, b, gamma, beta = rand(rng, B, T, C) * 2 + 1, rand(rng, B, T, C), rand(rng, C), rand(rng, C)
    R, S = rand(rng, B, T, C), rand(rng, B, T, C)

    def loss(a, b):
        x, out, mean, rstd = np.zeros((B, T, C)), np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T))
        E.residual_layernorm_fwd(x, out, mean, rstd, a, b, gamma, beta)
        return np.sum(out * R) + np.sum(x * S), x, mean, rstd

    _, x, mean, rstd = loss(a, b)
    dinp, dbranch = S.copy(), np.full((B, T, C), np.nan)
    dgamma, dbeta = np.zeros(C), np.zeros(C)
    E.layernorm_residual_bwd(dinp, dbranch, dgamma, dbeta, R, x, gamma, mean, rstd)
    np.testing.assert_array_equal(dbranch, dinp)
    for arr in (a, b):
        for i in rng.choice(arr.size, 12, replace=False):
            orig, h = arr.flat[i], 1e-6
            arr.flat[i] = orig + h
            lp = loss(a, b)[0]
            arr.flat[i] = orig - h
            lm = loss(a, b)[0]
            arr.flat[i] = orig
            assert dinp.flat[i] == pytest.approx((lp - lm) / (2 * h), rel=1e-6, abs=1e-8)


def loss_op_fixture(seed):
    rng = np.random.default_rng(seed)
    inp, wte = rand(rng, B, T, C), rand(rng, V, C)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)

    def loss(inp, wte):
        losses, probs = np.zeros((B, T)), np.zeros((B, T, V))
        E.loss_fwd(losses, probs, inp, wte, targets)
        return losses, probs

    return inp, wte, targets, loss


def test_loss_gradient_matches_finite_difference():
    inp, wte, targets, loss = loss_op_fixture(3)
    losses, probs = loss(inp, wte)
    ref = -np.log(np.exp(inp @ wte.T)[np.arange(B)[:, None], np.arange(T), targets] / np.exp(inp @ wte.T).sum(-1))
    np.testing.assert_allclose(losses, ref, rtol=1e-12)
    scale = 1.0 / (B * T)
    dinp, dwte = np.zeros_like(inp), np.zeros_like(wte)
    E.loss_bwd(dinp, dwte, probs, inp, wte, targets, scale, dlogits=np.zeros((B, T, V)))
    rng = np.random.default_rng(0)
    for arr, grad in ((inp, dinp), (wte, dwte)):
        for i in rng.choice(arr.size, 12, replace=False):
            orig, h = arr.flat[i], 1e-6
            arr.flat[i] = orig + h
            lp = loss(inp, wte)[0].sum() * scale
            arr.flat[i] = orig - h
            lm = loss(inp, wte)[0].sum() * scale
            arr.flat[i] = orig
            assert grad.flat[i] == pytest.approx((lp - lm) / (2 * h), rel=1e-6, abs=1e-9)
    once = (dinp.copy(), dwte.copy())
    E.loss_bwd(dinp, dwte, probs, inp, wte, targets, scale, dlogits=np.zeros((B, T, V)))
    np.testing.assert_allclose(dinp, 2 * once[0], rtol=1e-12)
    np.testing.assert_allclose(dwte, 2 * once[1], rtol=1e-12)


def loss_weights(rng, kind):
    """0/1 weights (a loss mask) or any non-negative ones (fractions and over 1); zeros in both."""
    w = (rng.random((B, T)) < 0.6).astype(np.float64) if kind == "mask" else rng.uniform(0.0, 2.0, (B, T))
    w[0, :2] = 0.0
    w[1, -1] = 1.0
    return w


@pytest.mark.parametrize("kind", ["mask", "real"])
@pytest.mark.parametrize("in_place", [False, True], ids=["dlogits", "in_place"])
def test_weighted_loss_gradient_matches_finite_difference(kind, in_place):
    """loss_bwd with weights is the gradient of scale * sum(w * losses), adds into its gradients (twice: double),
    and leaves w * (probs - onehot) in d_logits."""
    inp, wte, targets, loss = loss_op_fixture(4)
    rng = np.random.default_rng(8)
    w = loss_weights(rng, kind)
    _, probs = loss(inp, wte)
    scale = 0.37
    dinp, dwte = np.zeros_like(inp), np.zeros_like(wte)

    def backward():
        d = probs.copy()  # in place: the call turns it into d_logits
        dlogits = None if in_place else np.full((B, T, V), np.nan)
        E.loss_bwd(dinp, dwte, d, inp, wte, targets, scale, dlogits=dlogits, weights=w)
        return d if in_place else dlogits

    dlogits = backward()
    onehot = np.zeros((B, T, V))
    np.put_along_axis(onehot, targets[..., None], 1.0, -1)
    np.testing.assert_allclose(dlogits, w[..., None] * (probs - onehot), rtol=0, atol=1e-15)
    for arr, grad in ((inp, dinp), (wte, dwte)):
        for i in rng.choice(arr.size, 12, replace=False):
            orig, h = arr.flat[i], 1e-6
            arr.flat[i] = orig + h
            lp = scale * np.sum(w * loss(inp, wte)[0])
            arr.flat[i] = orig - h
            lm = scale * np.sum(w * loss(inp, wte)[0])
            arr.flat[i] = orig
            assert grad.flat[i] == pytest.approx((lp - lm) / (2 * h), rel=1e-6, abs=1e-9)
    once = (dinp.copy(), dwte.copy())
    backward()
    np.testing.assert_allclose(dinp, 2 * once[0], rtol=1e-12)
    np.testing.assert_allclose(dwte, 2 * once[1], rtol=1e-12)


@pytest.mark.parametrize("in_place", [False, True], ids=["dlogits", "in_place"])
def test_loss_weights_of_one_give_the_unweighted_bits(in_place):
    inp, wte, targets, loss = loss_op_fixture(6)
    _, probs = loss(inp, wte)
    out = []
    for weights in (None, np.ones((B, T))):
        d, dinp, dwte = probs.copy(), np.full_like(inp, np.nan), np.ones_like(wte)
        dlogits = None if in_place else np.full((B, T, V), np.nan)
        E.loss_bwd(dinp, dwte, d, inp, wte, targets, 0.1, dlogits=dlogits, overwrite=True, weights=weights)
        out.append((d if in_place else dlogits, dinp, dwte))
    for unweighted, weighted in zip(*out):
        np.testing.assert_array_equal(weighted, unweighted)


def test_weighted_mean_loss_leaves_out_positions_of_weight_zero():
    """sum(w * losses) / sum(w) in float64; a position of weight 0 counts for nothing, even a non-finite loss;
    weights that count nothing are refused."""
    losses = np.array([[1.0, 2.0, np.inf], [4.0, 8.0, 16.0]])
    w = np.array([[1.0, 0.5, 0.0], [0.0, 2.0, 0.0]])
    assert E.mean_loss(losses, w) == pytest.approx((1.0 + 1.0 + 16.0) / 3.5, rel=1e-15)
    assert E.mean_loss(losses[1:]) == pytest.approx(28 / 3, rel=1e-15)
    with pytest.raises(ValueError, match="no target counts"):
        E.mean_loss(losses, np.zeros_like(w))


def test_grad_norm_and_its_scale():
    rng = np.random.default_rng(1)
    g = rng.standard_normal(10_001)
    partials, norm = np.zeros(64), np.zeros(1)
    E.grad_norm_partial(partials, g)
    E.grad_norm_final(norm, partials)
    assert norm[0] == pytest.approx(np.linalg.norm(g), rel=1e-12)
    before, kept = norm[0], g.copy()
    E.grad_norm_partial(partials, g, scale=0.5)
    E.grad_norm_final(norm, partials)
    assert norm[0] == pytest.approx(0.5 * before, rel=1e-12)
    assert np.array_equal(g, kept)  # the gradient is read, not rewritten


def test_adamw_matches_textbook_formula():
    rng = np.random.default_rng(2)
    p, g = rng.standard_normal(20), rng.standard_normal(20)
    m, v = rng.standard_normal(20) * 0.1, rng.random(20) * 0.1
    want_m = 0.9 * m + 0.1 * g
    want_v = 0.95 * v + 0.05 * g * g
    upd = (want_m / (1 - 0.9**3)) / (np.sqrt(want_v / (1 - 0.95**3)) + 1e-8)
    decay = np.zeros(20)
    decay[5:12] = 0.1
    want_p = p - 0.01 * (upd + decay * p)
    E.adamw_step(p, g, m, v, lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3, decay_ranges=[(5, 12)])
    np.testing.assert_allclose(m, want_m, rtol=1e-12)
    np.testing.assert_allclose(v, want_v, rtol=1e-12)
    np.testing.assert_allclose(p, want_p, rtol=1e-12)


def tiny_model(micro_batch, seed=0):
    shape = load_experiment(EXPERIMENTS / "ANDREA-tiny-TRAIN.json").model
    model = Model(NumpyEngine("float64"), shape, micro_batch)
    params = init_params(model.layout, seed).astype(np.float64)
    params += np.random.default_rng(seed + 1).normal(0, 0.05, params.shape)  # non-trivial LN params
    model.load_state(params)
    return model, shape


def test_whole_model_gradient_matches_finite_difference():
    model, shape = tiny_model(micro_batch=2)
    rng = np.random.default_rng(5)
    x = rng.integers(0, shape.vocab_size, (2, shape.seq_len)).astype(np.int32)
    y = rng.integers(0, shape.vocab_size, (2, shape.seq_len)).astype(np.int32)
    model.forward_backward(x, y)
    grads = model.buf["grads"].copy()
    params = model.buf["params"]
    # probe every tensor of the layout, a few entries each
    for t in model.layout.tensors:
        for i in t.offset + rng.choice(t.size, 2, replace=False):
            orig, h = params[i], 1e-6
            params[i] = orig + h
            lp = model.forward(x, y)
            params[i] = orig - h
            lm = model.forward(x, y)
            params[i] = orig
            assert grads[i] == pytest.approx((lp - lm) / (2 * h), rel=1e-5, abs=1e-9), t.name


def test_two_micro_batches_equal_one_batch():
    exp = load_experiment(EXPERIMENTS / "ANDREA-tiny-TRAIN.json")
    rng = np.random.default_rng(9)
    x = rng.integers(0, 512, (4, 64)).astype(np.int32)
    y = rng.integers(0, 512, (4, 64)).astype(np.int32)
    whole, _ = tiny_model(micro_batch=4)
    split, _ = tiny_model(micro_batch=2)
    opt = dict(exp.optimizer, grad_clip=0.5)  # clipping active: the norm must agree too
    lw, nw = whole.train_step([(x, y)], step=0, lr=1e-3, optimizer=opt)
    ls, ns = split.train_step([(x[:2], y[:2]), (x[2:], y[2:])], step=0, lr=1e-3, optimizer=opt)
    assert ls == pytest.approx(lw, rel=1e-12)
    assert ns == pytest.approx(nw, rel=1e-12)
    for k in ("params", "m", "v"):
        np.testing.assert_allclose(split.buf[k], whole.buf[k], rtol=1e-10, atol=1e-14)
    # grads keep the step's gradient, unscaled: the two micro-batches' means add up to twice the whole batch's
    np.testing.assert_allclose(split.buf["grads"], 2 * whole.buf["grads"], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("loss_chunks", [1, 2])
def test_each_step_writes_its_gradient_whole(loss_chunks):
    """Nothing zeroes the gradient between steps: each step's first micro-batch writes every element of it (the
    others add). NaN left in grads before every step changes no bit of the run, with wte's gradient from one
    classifier piece or two and the embedding's share added after it."""
    shape = load_experiment(EXPERIMENTS / "ANDREA-tiny-TRAIN.json").model
    runs = [train_run(NumpyEngine(), shape, micro_batch=2, n_micro=2, steps=3, loss_chunks=loss_chunks,
                      poison_grads=poison) for poison in (False, True)]
    assert all(np.isfinite(run.losses).all() for run in runs)
    assert runs[0].digest == runs[1].digest


def test_loss_gradient_in_place_matches_a_separate_buffer():
    """loss_bwd may turn probs itself into d_logits (the model's classifier keeps one [B, T, V] buffer):
    the same gradients as with a buffer of its own, and probs ends as probs - onehot(targets)."""
    inp, wte, targets, loss = loss_op_fixture(5)
    _, probs = loss(inp, wte)
    scale = 1.0 / (B * T)
    separate = np.zeros((B, T, V))
    d_own = (np.zeros_like(inp), np.zeros_like(wte))
    E.loss_bwd(*d_own, probs, inp, wte, targets, scale, dlogits=separate)
    onehot = np.zeros((B, T, V))
    np.put_along_axis(onehot, targets[..., None], 1.0, -1)
    np.testing.assert_allclose(separate, probs - onehot, rtol=0, atol=1e-15)
    shared = probs.copy()
    d_shared = (np.zeros_like(inp), np.zeros_like(wte))
    E.loss_bwd(*d_shared, shared, inp, wte, targets, scale)
    np.testing.assert_array_equal(shared, separate)
    for a, b in zip(d_shared, d_own):
        np.testing.assert_array_equal(a, b)
