"""Precision fp8: the per-tensor scales, the casts byte for byte against the NumPy reference (andrea/ops/fp8.py),
and the FP8 products against float64 on the same FP8 operands. The CPU tests check the reference itself; the
`gpu` ones the kernels and cuBLASLt's FP8 products."""

import numpy as np
import pytest

from andrea.ops import fp8

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


def test_the_scratch_holds_every_op_s_operands():
    """operand_bytes is mlp_bwd's need; attn_qkv_bwd's and the forward products' are smaller at any shape."""
    for B, T, C in ((1, 16, 16), (8, 1024, 768), (32, 512, 384), (4, 64, 64)):
        N, F = B * T, 4 * C
        need = {"attn_qkv_bwd": 7 * N * C + 3 * C * C, "mlp_bwd": N * C + 2 * N * F + C * F,
                "mlp_fwd": N * F + F * C, "attn_out_bwd": 3 * N * C + C * C}
        assert max(need.values()) <= fp8.operand_bytes(B, T, C)


def test_an_fp8_experiment_is_valid_and_the_numpy_engine_refuses_it(tmp_path):
    import json

    from andrea.config import load_experiment
    from andrea.errors import AndreaError
    from andrea.precision import PRECISIONS
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


# ---- on the GPU -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    from andrea.engines.cuda_engine import CudaEngine

    return CudaEngine(precision="fp8")


def _bf16(a):
    import ml_dtypes

    return np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch, rows, cols", [(1, 128, 192), (3, 100, 72), (1, 37, 24), (2, 64, 64)])
def test_the_cast_writes_the_reference_bytes_in_every_layout(engine, fmt, batch, rows, cols):
    """Plain and transposed, inside wider rows (ld, batch offsets as attn_qkv uses them), every byte the
    reference's; bytes outside the written matrices keep their poison; the descale is exact."""
    import cupy

    rng = np.random.default_rng()
    x = _bf16(rng.standard_normal((batch, rows, cols)) * 10.0 ** rng.uniform(-4, 4))
    want, descale = fp8.quantize(x, fmt)
    ldq, ldqt = batch * cols + 8, rows + 16  # side by side in wider rows, as attn_qkv's [N, 3C]
    q = cupy.full(rows * ldq, 0xA5, dtype=np.uint8)
    qt = cupy.full(batch * cols * ldqt, 0xA5, dtype=np.uint8)
    engine_x = cupy.asarray(x.astype("bfloat16"))
    d = engine._fp8_cast(engine_x, rows, cols, fmt, 0, q=q, ldq=ldq, q_batch=cols, qt=qt, ldqt=ldqt,
                         qt_batch=cols * ldqt, batch=batch)
    got_q = cupy.asnumpy(q).reshape(rows, ldq)
    got_qt = cupy.asnumpy(qt).reshape(batch, cols, ldqt)
    for z in range(batch):
        assert np.array_equal(got_q[:, z * cols:(z + 1) * cols], want[z]), z
        assert np.array_equal(got_qt[z, :, :rows], want[z].T), z
    assert np.all(got_q[:, batch * cols:] == 0xA5) and np.all(got_qt[:, :, rows:] == 0xA5)
    assert float(cupy.asnumpy(d)[0]) == descale


@pytest.mark.gpu
def test_fp8_products_equal_float64_on_the_same_fp8_operands(engine):
    """attn_out and attn_qkv forward and backward in fp8 against float64 products of the reference's FP8
    operands (what the engine multiplies), to bf16's rounding of the outputs; the same ops against the exact
    float64 products are a few per cent off (the FP8 rounding itself)."""
    import cupy

    rng = np.random.default_rng()
    N, C = 256, 128

    def deq(a, fmt):
        q, s = fp8.quantize(a, fmt)
        return fp8.dequantize(q, s, fmt)

    x = _bf16(rng.standard_normal((N, C)))
    W = _bf16(rng.standard_normal((C, C)) * C**-0.5)
    dout = _bf16(rng.standard_normal((N, C)) * 1e-3)
    dW0 = rng.standard_normal((C, C)).astype(np.float32)
    dev = {k: cupy.asarray(v.astype("bfloat16")) for k, v in (("x", x), ("W", W), ("dout", dout))}
    out = cupy.full((N, C), np.nan, dtype="bfloat16")
    engine.attn_out_fwd(out, dev["x"], dev["W"])
    dW = cupy.asarray(dW0)
    dinp = cupy.full((N, C), np.nan, dtype=np.float32)
    engine.attn_out_bwd(dinp, dW, dev["dout"], dev["x"], dev["W"], overwrite=True)
    ref = {"out": deq(x, "e4m3") @ deq(W, "e4m3"),
           "dW": dW0 + deq(x, "e4m3").T @ deq(dout, "e5m2"),
           "dinp": deq(dout, "e5m2") @ deq(W, "e4m3").T}
    exact = {"out": x.astype(np.float64) @ W, "dinp": dout.astype(np.float64) @ W.T}
    got = {"out": cupy.asnumpy(out).astype(np.float64), "dW": cupy.asnumpy(dW), "dinp": cupy.asnumpy(dinp)}
    for k in ref:
        rel = np.linalg.norm(got[k] - ref[k]) / np.linalg.norm(ref[k] - (dW0 if k == "dW" else 0))
        assert rel <= 1e-2, (k, rel)
    for k in exact:  # the comparison above can tell FP8 operands from exact ones
        assert np.linalg.norm(got[k] - exact[k]) / np.linalg.norm(exact[k]) > 5e-3, k

    Wqkv = _bf16(rng.standard_normal((3, C, C)) * C**-0.5)
    dqkv = _bf16(rng.standard_normal((3, N, C)) * 1e-3)
    qkv = cupy.full((3, N, C), np.nan, dtype="bfloat16")
    engine.attn_qkv_fwd(qkv, dev["x"], cupy.asarray(Wqkv.astype("bfloat16")))
    dWq0 = rng.standard_normal((3, C, C)).astype(np.float32)
    dWq = cupy.asarray(dWq0)
    dx = cupy.full((N, C), np.nan, dtype=np.float32)
    engine.attn_qkv_bwd(dx, dWq, cupy.asarray(dqkv.astype("bfloat16")), dev["x"], cupy.asarray(Wqkv.astype("bfloat16")),
                        overwrite=True)
    dq = deq(dqkv, "e5m2")  # one scale for Q, K and V's gradients together, as for the weights
    wq = deq(Wqkv, "e4m3")
    ref = {"qkv": np.stack([deq(x, "e4m3") @ wq[i] for i in range(3)]),
           "dW": np.stack([deq(x, "e4m3").T @ dq[i] for i in range(3)]),
           "dx": sum(dq[i] @ wq[i].T for i in range(3))}
    got = {"qkv": cupy.asnumpy(qkv).astype(np.float64), "dW": cupy.asnumpy(dWq) - dWq0, "dx": cupy.asnumpy(dx)}
    for k in ref:
        rel = np.linalg.norm(got[k] - ref[k]) / np.linalg.norm(ref[k])
        assert rel <= 1e-2, (k, rel)


@pytest.mark.gpu
def test_prepared_weight_copies_change_no_bit(engine, monkeypatch):
    """Training with the model's FP8 weight copies (cast once per weight update) and with every op casting its
    weights itself gives the same bytes: the copies are fresh after every AdamW step and every load."""
    from andrea.config import ModelShape
    from andrea.engines.crosscheck import train_run

    shape = ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=512, seq_len=64)
    prepared = train_run(engine, shape, micro_batch=4, n_micro=2, steps=4)
    assert engine._fp8_weights  # the copies were in use
    monkeypatch.setattr(type(engine), "prepare_fp8_weights", lambda self, buf, layers: setattr(self, "_fp8_weights", {}))
    per_call = train_run(engine, shape, micro_batch=4, n_micro=2, steps=4)
    assert prepared.digest == per_call.digest


def test_fp8_rounding_alone_keeps_tiny_training_with_fp32():
    """The FP8 rounding of the products (engines/fp8_emulation.py, the CUDA fp8 path's casts on the CPU) leaves
    200 steps of a tiny model within 1.5% of fp32 from the same init, and it does round (the losses differ)."""
    from andrea.config import ModelShape
    from andrea.engines.crosscheck import train_run
    from andrea.engines.fp8_emulation import Fp8EmulationEngine
    from andrea.engines.numpy_engine import NumpyEngine

    shape = ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=512, seq_len=64)
    ref = train_run(NumpyEngine(), shape, micro_batch=8, n_micro=1, steps=200)
    emulated = train_run(Fp8EmulationEngine(), shape, micro_batch=8, n_micro=1, steps=200)
    assert emulated.losses != ref.losses
    assert ref.losses[-1] < 0.6 * ref.losses[0]  # it learned
    assert abs(emulated.losses[-1] - ref.losses[-1]) / ref.losses[-1] <= 0.015, (emulated.losses[-1], ref.losses[-1])
