"""The masked loss through the model (NumPy engine): a step's loss is sum(w * loss) / sum(w) over all its
micro-batches and its gradient that loss's (finite differences), weights of one train exactly as no weights,
a micro-batch of weight 0 changes nothing and a step of weight 0 is refused, and the recorded micro-batches
(CUDA graphs, here a stand-in) do not grow with the steps' weights, under a loss scale too."""

import dataclasses

import numpy as np
import pytest

from andrea.spec.config import ModelShape, load_experiment
from andrea.schedule.crosscheck import OPTIMIZER, synthetic_micro_batches
from andrea.engines.numpy_engine import NumpyEngine
from andrea.schedule.model import EmptyStep, Model, NonFiniteStep, init_params
from conftest import EXPERIMENTS

SHAPE = ModelShape(n_layer=2, d_model=16, n_head=2, vocab_size=37, seq_len=8)
# lr 0 and beta1 0: the step leaves the weights as they were and its gradient in m (m = g), unclipped.
GRADIENT_IN_M = {"lr": 0.0, "betas": (0.0, 0.95), "eps": 1e-8, "weight_decay": 0.0, "grad_clip": 0.0}


def masks(rng, B, T, n):
    """n micro-batches' weights: a 0/1 mask, then fractional weights (some over 1) after a prompt of weight 0."""
    out = [(rng.random((B, T)) < 0.5).astype(np.float32)]
    for _ in range(n - 1):
        w = rng.uniform(0.0, 2.0, (B, T)).astype(np.float32)
        w[0, : T // 2] = 0.0
        out.append(w)
    return out


def new_model(engine, shape=SHAPE, micro_batch=2, seed=0, **kw):
    model = Model(engine, shape, micro_batch, **kw)
    params = init_params(model.layout, seed).astype(engine.dtype)
    params += np.random.default_rng(seed + 1).normal(0, 0.05, params.shape).astype(engine.dtype)  # non-trivial LN
    model.load_state(params)
    return model


def state(model) -> bytes:
    return b"".join(a.tobytes() for a in model.host_state())


def test_step_loss_and_gradient_are_the_weighted_means():
    """Over two micro-batches of different total weight: the loss is sum(w * ce) / sum(w) of the per-position
    losses, and the gradient is that loss's by finite differences (probing every tensor of the layout)."""
    shape = load_experiment(EXPERIMENTS / "ANDREA-tiny-TRAIN.json").model
    model = new_model(NumpyEngine("float64"), shape)
    rng = np.random.default_rng(3)
    batches = synthetic_micro_batches(shape, 2, 2, step=0)
    weights = masks(rng, 2, shape.seq_len, 2)
    per_position = []
    for x, y in batches:
        model.forward(x, y)
        per_position.append(model.buf["losses"].copy())
    total = sum(float(w.sum(dtype=np.float64)) for w in weights)
    want = sum(float(np.sum(w * ce)) for w, ce in zip(weights, per_position)) / total
    assert total not in (0, weights[0].size * 2)  # not every target counts, and weights differ by micro-batch

    def step_loss() -> float:
        return sum(float(w.sum(dtype=np.float64)) * model.forward(x, y, w) for (x, y), w in zip(batches, weights)) / total

    assert step_loss() == pytest.approx(want, rel=1e-12)
    loss, norm = model.train_step(batches, step=0, lr=0.0, optimizer=GRADIENT_IN_M, weights=weights)
    assert loss == pytest.approx(want, rel=1e-12)
    grads = model.buf["m"].copy()
    assert norm == pytest.approx(np.linalg.norm(grads), rel=1e-12)
    params = model.buf["params"]
    for t in model.layout.tensors:
        for i in t.offset + rng.choice(t.size, 2, replace=False):
            orig, h = params[i], 1e-6
            params[i] = orig + h
            lp = step_loss()
            params[i] = orig - h
            lm = step_loss()
            params[i] = orig
            assert grads[i] == pytest.approx((lp - lm) / (2 * h), rel=1e-5, abs=1e-9), t.name


def test_forward_takes_the_weighted_mean_and_refuses_weights_of_nothing():
    model = new_model(NumpyEngine("float64"))
    (x, y), = synthetic_micro_batches(SHAPE, 2, 1, step=0)
    w = masks(np.random.default_rng(0), 2, SHAPE.seq_len, 2)[1]
    model.forward(x, y)
    ce = model.buf["losses"].copy()
    assert model.forward(x, y, w) == pytest.approx(np.sum(w * ce) / np.sum(w, dtype=np.float64), rel=1e-12)
    with pytest.raises(ValueError, match="no target counts"):
        model.forward(x, y, np.zeros_like(w))


def test_weights_of_one_train_as_no_weights_bit_for_bit():
    runs = []
    for weighted in (False, True):
        model = new_model(NumpyEngine())
        losses = []
        for step in range(3):
            batches = synthetic_micro_batches(SHAPE, 2, 2, step)
            ones = [np.ones(y.shape, np.float32) for _, y in batches] if weighted else None
            losses.append(model.train_step(batches, step=step, lr=1e-3, optimizer=OPTIMIZER, weights=ones)[0])
        runs.append((losses, state(model)))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-12)
    assert runs[1][1] == runs[0][1]


def test_a_micro_batch_of_weight_zero_changes_nothing():
    """Beside it, the step is the step without it: the same loss and the same bits (no NaN from its 0 / 0)."""
    batches = synthetic_micro_batches(SHAPE, 2, 2, step=0)
    w = masks(np.random.default_rng(1), 2, SHAPE.seq_len, 1)[0]
    with_empty, alone = new_model(NumpyEngine()), new_model(NumpyEngine())
    got = with_empty.train_step(batches, step=0, lr=1e-3, optimizer=OPTIMIZER, weights=[w, np.zeros_like(w)])
    want = alone.train_step(batches[:1], step=0, lr=1e-3, optimizer=OPTIMIZER, weights=[w])
    assert np.isfinite(got).all() and got == want
    assert state(with_empty) == state(alone)


def test_a_step_of_weight_zero_raises_empty_step_and_changes_nothing():
    model = new_model(NumpyEngine())
    before = state(model)
    batches = synthetic_micro_batches(SHAPE, 2, 2, step=0)
    zeros = [np.zeros(y.shape, np.float32) for _, y in batches]
    with pytest.raises(EmptyStep, match="no target counts in this step's batch") as raised:
        model.train_step(batches, step=0, lr=1e-3, optimizer=OPTIMIZER, weights=zeros)
    assert isinstance(raised.value, NonFiniteStep)  # the trainer's skip / stop path
    assert state(model) == before and not model.buf["grads"].any()


def test_weights_are_checked():
    model = new_model(NumpyEngine())
    batches = synthetic_micro_batches(SHAPE, 2, 2, step=0)
    w = [np.ones(y.shape, np.float32) for _, y in batches]
    with pytest.raises(ValueError, match="1 weight arrays for 2 micro-batches"):
        model.train_step(batches, step=0, lr=1e-3, optimizer=OPTIMIZER, weights=w[:1])
    w[1][0, 0] = -0.5
    with pytest.raises(ValueError, match="non-negative"):
        model.train_step(batches, step=0, lr=1e-3, optimizer=OPTIMIZER, weights=w)


@pytest.mark.parametrize("B", [2, 3])
def test_weighted_loss_in_pieces_trains_the_same_model(B):
    """The classifier in pieces reads each piece's rows of the weights."""
    runs = []
    for chunks in (1, 2):
        model = new_model(NumpyEngine("float64"), micro_batch=B, loss_chunks=chunks)
        rng = np.random.default_rng(4)
        losses = [model.train_step(synthetic_micro_batches(SHAPE, B, 2, step), step=step, lr=1e-3, optimizer=OPTIMIZER,
                                   weights=masks(rng, B, SHAPE.seq_len, 2))[0] for step in range(3)]
        runs.append((losses, model.host_state()[0]))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-12)
    np.testing.assert_allclose(runs[1][1], runs[0][1], rtol=1e-9, atol=1e-12)


class TwoEqualRanks:
    """DataParallel's interface for two ranks that hold the same micro-batches: a sum over the ranks is twice
    this rank's value, a mean is its own."""

    world = 2

    def reduce_async(self, grads):
        grads *= 2

    def wait(self):
        pass

    def reduce_loss(self, loss):
        return loss


def test_data_parallel_weighted_step_is_the_step_over_every_rank():
    """The total weight and the loss are sums over the ranks: two equal ranks train as one GPU that takes both
    ranks' micro-batches."""
    batches = synthetic_micro_batches(SHAPE, 2, 2, step=0)
    weights = masks(np.random.default_rng(5), 2, SHAPE.seq_len, 2)
    ranks = new_model(NumpyEngine("float64"), data_parallel=TwoEqualRanks())
    one = new_model(NumpyEngine("float64"))
    got = ranks.train_step(batches, step=0, lr=1e-3, optimizer=OPTIMIZER, weights=weights)
    want = one.train_step(batches * 2, step=0, lr=1e-3, optimizer=OPTIMIZER, weights=weights * 2)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for a, b in zip(ranks.host_state(), one.host_state()):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)


class RecordingEngine(NumpyEngine):
    """The NumPy engine with the CUDA engine's graph traits: capture hands back the micro-batch's launches
    (replay runs them), counting the recordings; and a dynamic loss scale, as fp16 keeps."""

    def __init__(self):
        super().__init__("float64")
        self.traits = dataclasses.replace(self.traits, graphs=True, loss_scaling=True)
        self.captures = 0

    def capture(self, fn):
        self.captures += 1
        return fn

    def replay(self, graph):
        graph()


def test_recordings_do_not_grow_with_the_steps_weights_and_the_loss_scale_changes_no_bit():
    """Weighted steps of ever different total weight replay one recording a micro-batch place (unweighted steps
    others); a moved loss scale records them again. In float64 a power-of-two loss scale changes no bit of training."""
    engine = RecordingEngine()
    recorded, plain = new_model(engine), new_model(NumpyEngine("float64"))
    assert recorded.loss_scale is not None and recorded.graphs
    rng = np.random.default_rng(6)
    # recordings so far after each step, each a pair (the first micro-batch, which writes the gradient, and the
    # others, which add): the weighted pair, the unweighted pair (step 2), the weighted pair again at the moved
    # scale (step 4)
    for step, captures in enumerate((2, 2, 4, 4, 6, 6)):
        batches = synthetic_micro_batches(SHAPE, 2, 2, step)
        weights = None if step == 2 else masks(rng, 2, SHAPE.seq_len, 2)
        if step == 4:
            recorded.loss_scale.scale = 2.0**10
        got = recorded.train_step(batches, step=step, lr=1e-3, optimizer=OPTIMIZER, weights=weights)
        want = plain.train_step(batches, step=step, lr=1e-3, optimizer=OPTIMIZER, weights=weights)
        assert got == want, step
        assert engine.captures == captures, step
    assert state(recorded) == state(plain)
