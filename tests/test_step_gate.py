"""A training step launched whole: its micro-batches' loss sums kept on the engine, the clipping scale and the
decision to update made there (grad_gate), AdamW reading both, and the host reading once at the end. The same
bits as the step decided on the host (the data-parallel path, here forced), and a step that is not finite
changes no weight, also where only its loss is not."""

import numpy as np
import pytest

import andrea.schedule.model
from andrea.spec.config import ModelShape
from andrea.schedule.crosscheck import synthetic_micro_batches
from andrea.engines.numpy_engine import NumpyEngine
from andrea.schedule.model import Model, NonFiniteStep, init_params

SHAPE = ModelShape(n_layer=2, d_model=32, n_head=2, vocab_size=61, seq_len=16)
# a clip far under the gradient's norm, so that every step clips
CLIPPED = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 0.05}


def cuda_engine(precision):
    from andrea.engines.cuda_engine import CudaEngine

    return CudaEngine(precision=precision)


ENGINES = [pytest.param(lambda: NumpyEngine(), id="numpy"),
           pytest.param(lambda: cuda_engine("fp32"), id="cuda-fp32", marks=pytest.mark.gpu),
           pytest.param(lambda: cuda_engine("bf16"), id="cuda-bf16", marks=pytest.mark.gpu),
           pytest.param(lambda: cuda_engine("fp8"), id="cuda-fp8", marks=pytest.mark.gpu)]


def new_model(engine):
    model = Model(engine, SHAPE, micro_batch=2)
    model.load_state(init_params(model.layout, 3))
    return model


def state(model) -> bytes:
    return b"".join(a.tobytes() for a in model.host_state())


def run(model, weighted: bool, steps: int = 3):
    out = []
    for step in range(steps):
        batches = synthetic_micro_batches(SHAPE, 2, 3, step)
        weights = None
        if weighted:
            rng = np.random.default_rng(step)
            weights = [(rng.random(y.shape) < 0.6).astype(np.float32) for _, y in batches]
        out.append(model.train_step(batches, step=step, lr=1e-3, optimizer=CLIPPED, weights=weights))
    return out


@pytest.mark.parametrize("make", ENGINES)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "masked"])
def test_the_step_launched_whole_has_the_host_decided_step_s_bits(make, weighted, monkeypatch):
    engine = make()
    launched = new_model(engine)
    got = run(launched, weighted)
    monkeypatch.setattr(andrea.schedule.model, "LOSS_SLOTS", 0)  # more micro-batches than slots: the host decides
    decided = new_model(engine)
    want = run(decided, weighted)
    assert all(norm > CLIPPED["grad_clip"] for _, norm in want)  # the clipping's scale was in play
    assert got == want
    assert state(launched) == state(decided)


def poison(model, value: float) -> None:
    """One weight of wte set to `value`: the forward's logits, so the loss and the gradient, are not finite."""
    params = model.host_state()[0].copy()
    params[0] = value
    model.load_state(params)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NumPy on the poisoned weight
@pytest.mark.parametrize("make", ENGINES)
def test_a_step_that_is_not_finite_changes_no_weight(make):
    model = new_model(make())
    run(model, weighted=False, steps=1)  # m and v hold something
    poison(model, np.inf)
    before = state(model)
    with pytest.raises(NonFiniteStep, match="non-finite"):
        model.train_step(synthetic_micro_batches(SHAPE, 2, 2, 5), step=1, lr=1e-3, optimizer=CLIPPED)
    assert state(model) == before
    # grads keep the failed step's gradient: the next step's first micro-batch writes over it (nothing clears it;
    # tests/test_numpy_engine.py and tests/test_cuda_engine.py: test_each_step_writes_its_gradient_whole)
    assert not np.isfinite(model.engine.to_host(model.buf["grads"])).all()


@pytest.mark.parametrize("make", ENGINES)
def test_the_gate_stops_an_update_whose_loss_alone_is_not_finite(make):
    """A finite norm beside a loss sum that is not: no update (the host's rule, loss and norm finite)."""
    e = make()
    model = new_model(e)
    b = model.buf
    losses = np.abs(np.random.default_rng(0).standard_normal(b["losses"].shape)).astype(np.float32)
    e.upload(b["losses"], losses)
    e.loss_sums(b["losses"], slot=0)
    losses[1, 3] = np.nan
    e.upload(b["losses"], losses)
    e.loss_sums(b["losses"], slot=1)
    e.upload(b["grads"], np.full(model.layout.n_params, 1e-3, np.float32))
    e.upload(b["grad_norm"], np.array([0.5], np.float32))
    before = state(model)
    for n_losses, updates in ((2, False), (1, True)):
        e.grad_gate(b["grad_gate"], b["grad_norm"], n_losses, 1.0)
        e.adamw_step(b["params"], b["grads"], b["m"], b["v"], lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                     weight_decay=0.0, step=1, decay_ranges=model.layout.decay_ranges(), params_lp=b.get("params_lp"),
                     gate=b["grad_gate"])
        assert list(e.to_host(b["grad_gate"])) == [1.0, float(updates)]
        assert (state(model) != before) == updates
