"""The CUDA engine against the NumPy reference (needs a CUDA device; skipped elsewhere).

Every op pair on fresh random inputs, a few training steps engine against engine, determinism
(two runs, the same bits), and a training step that allocates nothing."""

import numpy as np
import pytest

from andrea.config import ModelShape
from andrea.engines.crosscheck import OPS, OpShape, compare_op, step_allocations, train_run
from andrea.errors import AndreaError

pytestmark = pytest.mark.gpu

SHAPE = ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=512, seq_len=64)
# Odd sizes too: rows and columns that fill no block or warp exactly.
ODD = ModelShape(n_layer=1, d_model=40, n_head=5, vocab_size=301, seq_len=37)
# Several 64-row tiles of the fused attention, the last one ragged, at its widest head (64).
LONG = ModelShape(n_layer=1, d_model=128, n_head=2, vocab_size=64, seq_len=150)
FP32_REL = 1e-5
TF32_REL = 5e-3


@pytest.fixture(scope="module")
def engines():
    from andrea.engines.cuda_engine import CudaEngine

    return {"fp32": CudaEngine(precision="fp32"), "tf32": CudaEngine(precision="tf32")}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [SHAPE, ODD], ids=["tiny", "odd"])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_op_matches_numpy(engines, op, shape, precision):
    seed = np.random.SeedSequence().entropy  # fresh inputs every run; the seed replays a failure
    result = compare_op({precision: engines[precision]}, op, OpShape.of(shape, B=3), np.random.default_rng(seed))
    limit = FP32_REL if precision == "fp32" else TF32_REL
    bad = {name: e for name, e in result[precision].items() if not e["rel"] <= limit}
    assert not bad, f"{op} ({precision}, seed {seed}): relative error over {limit}: {bad}"


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_attention_over_several_tiles(engines, precision):
    seed = np.random.SeedSequence().entropy
    result = compare_op({precision: engines[precision]}, "attn", OpShape.of(LONG, B=2), np.random.default_rng(seed))
    limit = FP32_REL if precision == "fp32" else TF32_REL
    bad = {name: e for name, e in result[precision].items() if not e["rel"] <= limit}
    assert not bad, f"attn ({precision}, seed {seed}): relative error over {limit}: {bad}"


def test_training_steps_match_numpy(engines):
    from andrea.engines.numpy_engine import NumpyEngine

    ref = train_run(NumpyEngine(), SHAPE, micro_batch=4, n_micro=2, steps=8)
    for precision, limit in (("fp32", 1e-4), ("tf32", 1e-2)):
        run = train_run(engines[precision], SHAPE, micro_batch=4, n_micro=2, steps=8)
        np.testing.assert_allclose(run.losses, ref.losses, rtol=limit, err_msg=precision)
        np.testing.assert_allclose(run.norms, ref.norms, rtol=10 * limit, err_msg=precision)


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_deterministic(engines, precision):
    first = train_run(engines[precision], SHAPE, micro_batch=4, n_micro=2, steps=4)
    second = train_run(engines[precision], SHAPE, micro_batch=4, n_micro=2, steps=4)
    assert first.digest == second.digest


def test_train_step_allocates_nothing(engines):
    from andrea.model import Model, init_params

    model = Model(engines["fp32"], SHAPE, micro_batch=4)
    model.load_state(init_params(model.layout, 0))
    step_allocations(model, step=0)  # the first step uploads the decay ranges once
    counts = step_allocations(model, step=1)
    assert counts["pool_requests"] == 0, counts
    assert counts["used_before"] == counts["used_after"], counts


def test_plan_is_one_allocation(engines):
    import cupy

    from andrea.model import Model

    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    model = Model(engines["fp32"], SHAPE, micro_batch=4)
    grown = pool.used_bytes() - before
    # one allocation: the plan's bytes but the engine's own buffers (held since the engine started), each
    # buffer padded to 256 bytes, rounded up by the pool (512)
    carved = model.plan.total_bytes - engines["fp32"].own_bytes
    assert {b.name for b in engines["fp32"].own_buffers} <= {b.name for b in model.plan.buffers}
    assert carved <= grown <= carved + 256 * len(model.plan.buffers) + 512


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_is_refused(precision):
    from andrea.engines.cuda_engine import CudaEngine

    with pytest.raises(AndreaError, match=precision):
        CudaEngine(precision=precision)
