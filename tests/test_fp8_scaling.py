"""Precision fp8's scales and the casts' NumPy reference (andrea/ops/fp8.py): the scale rule, quantize and
fake_quantize byte for byte, the bound that stands for dpre's amax (dgelu_amax), the histories' fold, and an fp8
experiment. The kernels are checked against this reference on the GPU (tests/test_fp8_cuda.py)."""

import numpy as np
import pytest

from andrea.ops import fp8
from conftest import fp8_history_row


FORMATS = list(fp8.FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_scale_is_the_largest_power_of_two_that_fits(fmt):
    rng = np.random.default_rng()
    emax, largest = fp8.FORMATS[fmt]
    amaxes = np.concatenate([10.0 ** rng.uniform(-20, 20, 2000), [largest, 1.75, 1.7500001, 1.0, 2.0**-30]])
    for amax in amaxes.astype(np.float32):
        e = fp8.scale_exponent(float(amax), fmt)
        assert float(amax) * 2.0**e <= largest, (amax, e)
        assert float(amax) * 2.0 ** (e + 1) > largest, (amax, e)
    assert fp8.scale_exponent(0.0, fmt) == 0


@pytest.mark.parametrize("fmt, step", [("e4m3", 2.0**-4), ("e5m2", 2.0**-3)])
def test_quantize_rounds_to_the_nearest_fp8_value(fmt, step):
    """Every value comes back within half a spacing of the FP8 values around it (3 or 2 mantissa bits: at
    most 2^-4 or 2^-3 of itself) above the subnormals, the largest |x| maps below the format's largest
    value, and an FP8 value maps to itself."""
    rng = np.random.default_rng()
    x = (rng.standard_normal(5000) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    q, descale = fp8.quantize(x, fmt)
    back = fp8.dequantize(q, descale, fmt)
    big = np.abs(x) >= np.max(np.abs(x)) * 2.0**-6
    assert np.all(np.abs(back[big] - x[big]) <= step * np.abs(x[big]) * (1 + 1e-6))
    assert np.any(np.abs(back[big] - x[big]) > step / 4 * np.abs(x[big]))  # it does round
    assert np.max(np.abs(back)) <= fp8.FORMATS[fmt][1] * descale
    # an FP8 value maps to itself (its scale may double: an amax rounded down to half the format's largest
    # value fits the next power of two)
    again, descale2 = fp8.quantize(back.astype(np.float32), fmt)
    assert descale2 in (descale, descale / 2)
    assert np.array_equal(fp8.dequantize(again, descale2, fmt), back)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fake_quantize_gives_the_cast_s_values_in_array_arithmetic(fmt):
    """fake_quantize (the rounding in plain float32 operations, for CuPy's fake-quantized products) equals
    dequantize(quantize(x)) bit for bit, subnormals and the largest value included, and is exact in bf16."""
    import ml_dtypes

    rng = np.random.default_rng()
    x = (rng.standard_normal(20000) * np.exp(rng.standard_normal(20000) * 3) * 10.0 ** rng.uniform(-3, 3))
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)  # the engine's activations are bf16
    got = fp8.fake_quantize(np, x, fmt)
    assert got.dtype == np.float32
    assert np.array_equal(got, fp8.dequantize(*fp8.quantize(x, fmt), fmt).astype(np.float32))
    assert np.array_equal(got.astype(ml_dtypes.bfloat16).astype(np.float32), got)
    assert not np.array_equal(got, x)


def test_the_dgelu_bound_holds_and_sits_a_few_bits_above_the_amax():
    """fp8.dgelu_amax, the scale of the MLP backward's E5M2 dpre: never under |dpre| of the FP8 operands' product
    (GELU' at its largest, operands of one sign: the sum as large as it gets), and for random operands at C 768
    under 2^11 above the amax, so that E5M2's 2^32 keeps every value over 2^-19 of the amax in its normal range."""
    from andrea.ops.mlp import _gelu_grad

    grid = np.linspace(-12.0, 12.0, 240_001)
    assert np.abs(_gelu_grad(grid)).max() < fp8.GELU_GRAD_BOUND / 1.1  # room for a product's rounding
    rng = np.random.default_rng()
    N, C = 256, 768
    F = 4 * C
    for same_sign in (True, False):
        dout = (rng.standard_normal((N, C)) * 10.0 ** rng.uniform(-8, -2)).astype(np.float32)
        W_2 = (rng.standard_normal((F, C)) * F**-0.5).astype(np.float32)
        pre = rng.standard_normal((N, F)).astype(np.float32) * 3
        if same_sign:
            dout, W_2, pre = np.abs(dout), np.abs(W_2), np.full_like(pre, 1.4185)  # GELU' at its largest there
        d, w = fp8.fake_quantize(np, dout, "e5m2"), fp8.fake_quantize(np, W_2, "e4m3")
        dpre = (d.astype(np.float64) @ w.T.astype(np.float64)) * _gelu_grad(pre.astype(np.float64))
        amax = np.abs(dpre).max()
        bound = fp8.dgelu_amax(C, fp8.descale(dout, "e5m2"), fp8.descale(W_2, "e4m3"))
        assert amax <= bound < 2.0**11 * amax, (same_sign, bound / amax)


@pytest.mark.parametrize("name", list(fp8.HISTORIES))
def test_a_history_scales_each_pass_by_the_largest_of_its_last_passes(name):
    """A pass's scale is the largest power of two that fits the largest amax of the layer's last passes in the
    history's format (at a run's start: act's 1, dqkv's that of amax 1), the pass before's scale becomes the pass's
    own (its descale, exact), NaN is passed over, the amax word is back at 0, and an amax leaves the history after
    FP8_HIST_PASSES passes."""
    fmt, start = fp8.HISTORIES[name]
    n = fp8.history_field("PASSES")
    row = fp8_history_row(name=name)
    assert row[fp8.history_field("SCALE")] == {"act": 1.0, "dqkv": 2.0**15}[name] == 2.0 ** fp8.scale_exponent(start, fmt)
    rng = np.random.default_rng()
    seen = []
    for i, a in enumerate([300.0, *rng.uniform(0.5, 4.0, 2 * n), float("nan"), 0.25]):
        before = float(row[fp8.history_field("SCALE")])
        row[fp8.history_field("AMAX")] = a  # what the producer left there
        fp8.fold_amax(row, a, fmt)
        seen.append(a)
        assert row[fp8.history_field("SCALE_NOW")] == before
        assert row[fp8.history_field("DESCALE_NOW")] == np.float32(1.0 / before)
        assert fp8.amax_now(row, fmt) * before == fp8.FORMATS[fmt][1]
        largest = np.fmax.reduce(np.array(seen[-n:], dtype=np.float32))
        assert row[fp8.history_field("SCALE")] == 2.0 ** fp8.scale_exponent(largest, fmt), i
        assert int(row[fp8.history_field("AT")]) == (i + 1) % n
        assert row[fp8.history_field("AMAX")] == 0.0
    assert row[fp8.history_field("SCALE")] > 2.0 ** fp8.scale_exponent(300.0, fmt)  # 300 left the history


def test_an_fp8_experiment_is_valid_and_the_numpy_engine_refuses_it(tmp_path):
    import json

    from andrea.spec.config import load_experiment
    from andrea.common.errors import AndreaError
    from andrea.spec.precision import PRECISIONS
    from conftest import EXPERIMENTS

    raw = json.loads((EXPERIMENTS / "ANDREA-tiny-TRAIN.json").read_text())
    raw["precision"] = "fp8"
    path = tmp_path / "tiny-fp8.json"
    path.write_text(json.dumps(raw))
    assert load_experiment(path).precision == "fp8"
    assert PRECISIONS["fp8"].needs_cuda and PRECISIONS["fp8"].act_dtype == "bfloat16"
    from andrea.engines import make_engine

    with pytest.raises(AndreaError, match="fp8"):
        make_engine("numpy", precision="fp8")
