"""The op cross-check harness on the CPU: the NumPy engine in float32 against its float64 self, on every
op case the CUDA engine is checked with (overwritten input gradients start as NaN, so a case whose op
fails to write one, or adds into it, shows here)."""

import numpy as np
import pytest

from andrea.spec.config import ModelShape
from andrea.schedule.crosscheck import OPS, OpShape, compare_op
from andrea.engines.numpy_engine import NumpyEngine

SHAPE = ModelShape(n_layer=1, d_model=16, n_head=2, vocab_size=31, seq_len=7)


@pytest.mark.parametrize("op", OPS)
def test_float32_numpy_engine_matches_float64_on_every_case(op):
    seed = np.random.SeedSequence().entropy
    result = compare_op({"float32": NumpyEngine("float32")}, op, OpShape.of(SHAPE, B=2), np.random.default_rng(seed))
    errors = {name: e["rel"] for name, e in result["float32"].items()}
    assert errors and all(rel <= 1e-5 for rel in errors.values()), f"{op} (seed {seed}): {errors}"


def test_overwrite_ignores_what_the_input_gradient_held():
    """The same backward with overwrite into a buffer of garbage and with += into zeros: the same numbers."""
    E = NumpyEngine("float64")
    rng = np.random.default_rng(5)
    B, T, C = 2, 5, 8
    inp, W_O, dout = rng.standard_normal((B, T, C)), rng.standard_normal((C, C)), rng.standard_normal((B, T, C))
    written, added = rng.standard_normal((B, T, C)), np.zeros((B, T, C))
    E.attn_out_bwd(written, np.zeros((C, C)), dout, inp, W_O, overwrite=True)
    E.attn_out_bwd(added, np.zeros((C, C)), dout, inp, W_O)
    np.testing.assert_array_equal(written, added)


def test_weighted_loss_cases_hold_every_kind_of_weight_and_catch_an_engine_that_ignores_them():
    """Weights 0, 1, fractions and over 1, and a run of zero rows: each path of the weighted backward; an engine
    whose loss_bwd drops the weights fails both cases."""
    from andrea.schedule.crosscheck import make_case

    s = OpShape.of(SHAPE, B=2)
    w = make_case("loss_weighted", s, np.random.default_rng(0)).arrays["weights"].ravel()
    assert (w == 0).any() and (w == 1).any() and (w > 1).any() and ((w > 0) & (w < 1)).any()
    assert "0" * 4 in "".join("0" if x == 0 else "1" for x in w)

    class IgnoresWeights(NumpyEngine):
        def loss_bwd(self, *args, weights=None, **kwargs):
            super().loss_bwd(*args, **kwargs)

    for op in ("loss_weighted", "loss_weighted_in_place"):
        result = compare_op({"bad": IgnoresWeights("float32")}, op, s, np.random.default_rng(1))["bad"]
        assert min(result["dinp"]["rel"], result["dwte"]["rel"]) > 1e-3, op  # the limit is 1e-5


def test_text_micro_batches_are_shifted_windows_of_the_shard_and_a_function_of_seed_and_step():
    from andrea.schedule.crosscheck import text_micro_batches

    tokens = np.arange(10_000, dtype=np.uint16)  # each window's values say where it starts
    (x, y), (x2, y2) = text_micro_batches(tokens, 64, 3, 2, step=5, seed=1)
    for tok, tgt in ((x, y), (x2, y2)):
        assert tok.shape == tgt.shape == (3, 64) and tok.dtype == np.int32
        assert (np.diff(tok, axis=1) == 1).all() and (tgt == tok + 1).all()
    again = text_micro_batches(tokens, 64, 3, 2, step=5, seed=1)
    assert all((a == b).all() for pair in zip(again, [(x, y), (x2, y2)]) for a, b in zip(*pair))
    assert not (text_micro_batches(tokens, 64, 3, 2, step=6, seed=1)[0][0] == x).all()
    with pytest.raises(ValueError, match="no window"):
        text_micro_batches(tokens[:64], 64, 1, 1, step=0)


def test_train_run_held_out_loss_falls_with_training_on_a_learnable_shard():
    from andrea.schedule.crosscheck import text_micro_batches, train_run

    shape = ModelShape(n_layer=1, d_model=32, n_head=2, vocab_size=64, seq_len=16)
    tokens = np.tile(np.random.default_rng(0).integers(0, 64, 37), 200).astype(np.uint16)
    held = text_micro_batches(tokens, 16, 4, 1, step=0, seed=99)
    runs = [train_run(NumpyEngine(), shape, 4, 1, steps, stream=lambda s: text_micro_batches(tokens, 16, 4, 1, s),
                      held_out=held) for steps in (0, 40)]
    assert runs[0].held_out == pytest.approx(np.log(64), rel=0.05)  # untrained: about uniform
    assert runs[1].held_out < 0.8 * runs[0].held_out
    assert train_run(NumpyEngine(), shape, 4, 1, 1).held_out is None


def test_grad_rows_reads_both_layouts_of_dqkv_and_refuses_others():
    """The attention backward and attn_qkv_bwd take dqkv contiguous or as a view of rows [B, T, 3, C] (the model's);
    a layout whose strides the kernels cannot follow is one clear error, not wrong gradients."""
    from andrea.common.errors import AndreaError
    from andrea.ops.attn import grad_rows

    B, T, C = 2, 5, 8
    assert grad_rows(np.zeros((3, B, T, C), np.float32)) == (C, B * T * C)
    assert grad_rows(np.zeros((B, T, 3, C), np.float32).transpose(2, 0, 1, 3)) == (3 * C, C)
    assert grad_rows(np.zeros((3, B * T, C))) == (C, B * T * C)  # B and T as one axis of rows
    for bad in (np.zeros((3, T, B, C)).transpose(0, 2, 1, 3),  # T before B in memory
                np.zeros((B, 3, T, C)).transpose(1, 0, 2, 3),  # the planes inside a batch row
                np.zeros((3, B, T, 2 * C))[..., :C]):  # rows wider than C: not one of the two layouts
        with pytest.raises(AndreaError, match="dqkv"):
            grad_rows(bad)
