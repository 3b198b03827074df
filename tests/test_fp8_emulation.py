"""The NumPy engine with precision fp8's rounding (andrea/engines/fp8_emulation.py): the act and dqkv histories'
scales as the CUDA path takes them, a resume that restores them, and what the rounding alone does to training."""

import numpy as np
import pytest

from andrea.ops import fp8
from conftest import fp8_history_row


def test_the_fp8_emulation_rounds_act_at_the_history_s_scale():
    """In a pass with a history row the emulation's MLP multiplies act rounded at the row's scale (not its own
    amax's), folds act's amax into the row, and its backward reads act at the same scale."""
    from andrea.engines.fp8_emulation import Fp8EmulationEngine

    E = Fp8EmulationEngine()
    rng = np.random.default_rng()
    N, C = 64, 32
    F = 4 * C
    inp, W_1, W_2 = (rng.standard_normal(s).astype(np.float32) * f for s, f in
                     (((N, C), 1.0), ((C, F), C**-0.5), ((F, C), F**-0.5)))
    dout = rng.standard_normal((N, C)).astype(np.float32)
    q = E.fp8_operand

    def run(row):
        out, pre, act = np.zeros((N, C), np.float32), np.zeros((N, F), np.float32), np.zeros((N, F), np.float32)
        dinp, dW_1, dW_2, dpre = (np.zeros(s, np.float32) for s in ((N, C), (C, F), (F, C), (N, F)))
        E.mlp_fwd(out, pre, act, inp, W_1, W_2, act_history=row)
        E.mlp_bwd(dinp, dW_1, dW_2, dpre, dout, inp, pre, act, W_1, W_2, act_history=row)
        return out, dW_2, act

    own_out, own_dW_2, act = run(None)
    row = fp8_history_row([1e3 * np.abs(act).max()])  # a history far above act: a scale 2^10 below its own
    at = int(row[fp8.history_field("AT")])
    out, dW_2, _ = run(row)
    at_scale = q(act, "e4m3", fp8.amax_now(row, "e4m3"))
    np.testing.assert_array_equal(out, E.mm(at_scale, q(W_2, "e4m3")))
    np.testing.assert_array_equal(dW_2, E.mm(at_scale.T, q(dout, "e5m2")))
    assert not np.array_equal(out, own_out) and not np.array_equal(dW_2, own_dW_2)
    assert row[fp8.history_field("PAST") + at] == np.float32(np.abs(act).max())


def test_the_fp8_emulation_rounds_dqkv_at_the_history_s_scale():
    """With a history row attn_bwd folds dqkv's amax into it and attn_qkv_bwd's products read dqkv rounded at the
    pass's scale (not its own amax's)."""
    from andrea.engines.fp8_emulation import Fp8EmulationEngine

    E = Fp8EmulationEngine()
    rng = np.random.default_rng()
    B, T, C, H = 2, 16, 32, 2
    qkv = rng.standard_normal((3, B, T, C)).astype(np.float32)
    out, att = np.zeros((B, T, C), np.float32), np.zeros((B, H, T, T), np.float32)
    E.attn_fwd(out, att, qkv, H)
    dout, inp = (rng.standard_normal((B, T, C)).astype(np.float32) for _ in range(2))
    W_QKV = rng.standard_normal((3, C, C)).astype(np.float32) * C**-0.5
    q = E.fp8_operand

    def run(row):
        dqkv, datt = np.zeros((3, B, T, C), np.float32), np.zeros((B, H, T, T), np.float32)
        E.attn_bwd(dqkv, datt, dout, qkv, out, att, H, overwrite=True, dqkv_history=row)
        dinp, dW = np.zeros((B, T, C), np.float32), np.zeros((3, C, C), np.float32)
        E.attn_qkv_bwd(dinp, dW, dqkv, inp, W_QKV, overwrite=True, overwrite_weights=True, dqkv_history=row)
        return dqkv, dinp, dW

    dqkv, own_dinp, own_dW = run(None)
    # a history 8 times below dqkv's amax: a scale 2^3 above its own, so its largest values saturate (a history far
    # above moves E5M2's rounding only where values fall under its normal range, 2^-30 of the amax: not in every draw)
    row = fp8_history_row([np.abs(dqkv).max() / 8], "dqkv")
    at = int(row[fp8.history_field("AT")])
    again, dinp, dW = run(row)
    np.testing.assert_array_equal(again, dqkv)
    at_scale = q(dqkv, "e5m2", fp8.amax_now(row, "e5m2"))
    x, W = q(inp, "e4m3").reshape(-1, C), q(W_QKV, "e4m3")
    np.testing.assert_array_equal(dW, np.stack([E.mm(x.T, at_scale[i].reshape(-1, C)) for i in range(3)]))
    np.testing.assert_array_equal(dinp, sum(E.mm(at_scale[i], W[i].T) for i in range(3)))
    assert not np.array_equal(dinp, own_dinp) and not np.array_equal(dW, own_dW)
    assert row[fp8.history_field("PAST") + at] == np.float32(np.abs(dqkv).max())


def test_a_resumed_fp8_emulation_run_restores_its_histories():
    """Steps, then the weights, m, v and the act and dqkv histories through JSON into a fresh model, then more steps:
    the bytes of the run without the break. Resuming without either history gives other bytes (each is state)."""
    import json

    from andrea.spec.config import ModelShape
    from andrea.schedule.crosscheck import OPTIMIZER, lr_at, synthetic_micro_batches
    from andrea.engines.fp8_emulation import Fp8EmulationEngine
    from andrea.schedule.model import Model, init_params

    shape = ModelShape(n_layer=2, d_model=32, n_head=2, vocab_size=128, seq_len=32)

    def steps(model, first, last):
        for step in range(first, last):
            model.train_step(synthetic_micro_batches(shape, 4, 2, step, 3), step=step, lr=lr_at(step),
                             optimizer=OPTIMIZER)

    def fresh():
        model = Model(Fp8EmulationEngine(), shape, 4)
        model.load_state(init_params(model.layout, 3))
        return model

    whole = fresh()
    steps(whole, 0, 5)
    broken = fresh()
    steps(broken, 0, 3)
    saved, state = broken.host_state(), json.loads(json.dumps(broken.history_state()))
    assert sorted(state) == ["fp8_act_history", "fp8_dqkv_history"]
    for rows in state.values():
        assert np.asarray(rows).shape == (2, fp8.history_field("ROW"))
        assert np.all(np.asarray(rows)[:, fp8.history_field("PAST")] > 0)
    results = []
    for restored in (state, {}, {"fp8_act_history": state["fp8_act_history"]},
                     {"fp8_dqkv_history": state["fp8_dqkv_history"]}):
        resumed = fresh()
        resumed.load_state(*saved)
        resumed.load_histories(restored)
        steps(resumed, 3, 5)
        results.append(resumed.host_state()[0])
    np.testing.assert_array_equal(results[0], whole.host_state()[0])
    for partial in results[1:]:
        assert not np.array_equal(partial, results[0])


@pytest.mark.slow  # 2 x 200 training steps
def test_fp8_rounding_alone_keeps_tiny_training_with_fp32():
    """The FP8 rounding of the products (engines/fp8_emulation.py, the CUDA fp8 path's casts on the CPU) leaves
    200 steps of a tiny model within 1.5% of fp32 from the same init, and it does round (the losses differ)."""
    from andrea.spec.config import ModelShape
    from andrea.schedule.crosscheck import train_run
    from andrea.engines.fp8_emulation import Fp8EmulationEngine
    from andrea.engines.numpy_engine import NumpyEngine

    shape = ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=512, seq_len=64)
    ref = train_run(NumpyEngine(), shape, micro_batch=8, n_micro=1, steps=200)
    emulated = train_run(Fp8EmulationEngine(), shape, micro_batch=8, n_micro=1, steps=200)
    assert emulated.losses != ref.losses
    assert ref.losses[-1] < 0.6 * ref.losses[0]  # it learned
    assert abs(emulated.losses[-1] - ref.losses[-1]) / ref.losses[-1] <= 0.015, (emulated.losses[-1], ref.losses[-1])
