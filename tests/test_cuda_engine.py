"""The CUDA engine against the NumPy reference (needs a CUDA device; skipped elsewhere).

Every op pair on fresh random inputs, a few training steps engine against engine, determinism
(two runs, the same bits), and a training step that allocates nothing."""

import numpy as np
import pytest

from andrea.spec.config import ModelShape
from andrea.schedule.crosscheck import OP_LIMITS, OPS, OpShape, compare_op, step_allocations, train_run
from andrea.common.errors import AndreaError

pytestmark = pytest.mark.gpu

SHAPE = ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=512, seq_len=64)
# Odd sizes too: rows and columns that fill no block or warp exactly.
ODD = ModelShape(n_layer=1, d_model=40, n_head=5, vocab_size=301, seq_len=37)
# Several 64-row tiles of the fused attention, the last one ragged, at its widest head (64).
LONG = ModelShape(n_layer=1, d_model=128, n_head=2, vocab_size=64, seq_len=150)
# ||got - ref|| / ||ref|| against float64 on the same inputs (bf16: activations rounded to bf16 first)
REL = OP_LIMITS["small"]
PRECISIONS = tuple(REL)
# Head width 64, the bf16 engine's own attention kernels (kernels/attn_bf16.cu): 3 query tiles, the last ragged.
WIDE = ModelShape(n_layer=2, d_model=128, n_head=2, vocab_size=300, seq_len=150)


@pytest.fixture(scope="module")
def engines():
    from andrea.engines.cuda_engine import CudaEngine

    return {p: CudaEngine(precision=p) for p in PRECISIONS}


def assert_close_to_numpy(engines, precision, op, shape, B):
    seed = np.random.SeedSequence().entropy  # fresh inputs every run; the seed replays a failure
    result = compare_op({precision: engines[precision]}, op, OpShape.of(shape, B=B), np.random.default_rng(seed))
    bad = {name: e for name, e in result[precision].items() if not e["rel"] <= REL[precision]}
    assert not bad, f"{op} ({precision}, seed {seed}): relative error over {REL[precision]}: {bad}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [SHAPE, ODD], ids=["tiny", "odd"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_op_matches_numpy(engines, op, shape, precision):
    assert_close_to_numpy(engines, precision, op, shape, B=3)


# LayerNorm rows wider than the cached backward's registers (and, at 1100, not whole 16-byte groups): the
# generic kernel; at 1024 the bf16/fp16 builds take the widest cached one.
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("d_model", [1024, 1100])
@pytest.mark.parametrize("op", ["layernorm", "layernorm_residual"])
def test_layernorm_wide_rows(engines, precision, d_model, op):
    shape = ModelShape(n_layer=1, d_model=d_model, n_head=4, vocab_size=64, seq_len=9)
    assert_close_to_numpy(engines, precision, op, shape, B=3)


# The softmax keeps a row in registers up to LOSS_CACHED_GROUPS 16-byte groups a thread (kernels/loss.cu): 50,304
# (the 120M classifier's) fills some threads' last group and not others'; 65,552 is past them in every build and
# reads the row again; 4,096 on a smaller block; 301 not whole groups.
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("V", [50304, 65552, 4096, 301])
def test_softmax_rows_against_float64(engines, precision, V):
    """k_loss_fwd on stored logits (fresh random rows, no product before it) against float64's softmax of the same
    stored values: each loss to float32's sums, each probability to its own rounding."""
    import cupy

    from andrea.ops.loss import softmax_threads

    e = engines[precision]
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    N = 6
    probs = cupy.empty((N, V), dtype=e.traits.act_dtype)
    e.upload(probs, rng.standard_normal((N, V)) * 3.0)
    logits = e.to_host(probs).astype(np.float64)
    targets = rng.integers(0, V, N).astype(np.int32)
    losses = cupy.full(N, np.nan, dtype=np.float32)
    e.launch("k_loss_fwd", N, softmax_threads(V, e.act_vec), losses, probs, cupy.asarray(targets), np.uint64(0),
             np.uint64(0), np.int64(N), np.int32(V))
    top = logits.max(axis=1, keepdims=True)
    lse = top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    want = np.exp(logits - lse)
    np.testing.assert_allclose(e.to_host(losses), (lse[:, 0] - logits[np.arange(N), targets]), rtol=2e-6,
                               err_msg=f"seed {seed}")
    eps = {"float32": 2.0**-18, "float16": 2.0**-10, "bfloat16": 2.0**-7}[np.dtype(probs.dtype).name]
    tiny = 2.0**-24 if probs.dtype == np.float16 else 0.0  # fp16's subnormal step
    got = e.to_host(probs).astype(np.float64)
    assert (np.abs(got - want) <= eps * want + tiny).all(), f"seed {seed}: max rel {np.max(np.abs(got / want - 1))}"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [LONG, WIDE], ids=["long", "wide"])
def test_attention_over_several_tiles(engines, precision, shape):
    assert_close_to_numpy(engines, precision, "attn", shape, B=2)


def attention_bits(e, runs, B: int, T: int, H: int) -> tuple[int, list[dict]]:
    """(the seed, each run's bytes of Y, lse, D and dqkv): the forward and backward at kernels/attn_bf16.cu's head
    width (64) on fresh random inputs that the runs share, several query tiles with a ragged last one, the backward
    adding into old values. `runs` yields each run's engine: a copy of `e` with other kernels, or `e` itself after a
    change of how it launches them."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    C, act = 64 * H, e.traits.act_dtype
    host = {name: rng.standard_normal(shape) * 1.5 for name, shape in
            (("qkv", (3, B, T, C)), ("dout", (B, T, C)), ("old", (3, B, T, C)))}

    def device(shape, dtype, value):
        a = e.xp.empty(shape, dtype)
        e.upload(a, np.broadcast_to(value, shape))
        return a

    qkv, dout = device(host["qkv"].shape, act, host["qkv"]), device(host["dout"].shape, act, host["dout"])
    results = []
    for engine in runs:
        out, dqkv = device((B, T, C), act, np.nan), device(qkv.shape, act, host["old"])
        lse, datt = device((B, H, T), np.float32, np.nan), device((B, H, T), np.float32, np.nan)
        engine.attn_fwd(out, lse, qkv, H)
        engine.attn_bwd(dqkv, datt, dout, qkv, out, lse, H)
        results.append({k: e.to_host(v).view(np.uint8) for k, v in
                        {"out": out, "lse": lse, "D": datt, "dqkv": dqkv}.items()})
    return seed, results


def assert_same_bits(seed, results):
    for name in results[0]:
        assert all(np.array_equal(results[0][name], r[name]) for r in results[1:]), f"{name} differs (seed {seed})"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_hopper_attention_gives_the_mma_kernels_bits(engines, precision):
    """On Hopper the engine runs kernels/attn_bf16.cu's warpgroup kernels (k_attn_*_wg); they sum in the mma
    kernels' order, so both give the same bits."""
    import copy

    from andrea.ops.attn import HOPPER_KERNELS, MMA16_KERNEL_FILE

    e = engines[precision]
    own = HOPPER_KERNELS[MMA16_KERNEL_FILE]
    if own[0] not in e.k:
        pytest.skip("no warpgroup kernels loaded (not a Hopper GPU, or ANDREA_WGMMA=0)")
    mma = copy.copy(e)
    mma.k = {name: f for name, f in e.k.items() if name not in own}
    assert_same_bits(*attention_bits(e, (e, mma), B=2, T=333, H=3))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_build_without_warpgroup_kernels_trains_to_the_same_bits(precision):
    """CudaEngine(hopper_kernels=False) is the build sm_80 and sm_89 cards run (and ANDREA_WGMMA=0 on Hopper, and
    scripts/bench.py's -mma variants): on Hopper its training steps give the warpgroup build's weights, m and v."""
    import cupy

    from andrea.engines.cuda_engine import CudaEngine
    from andrea.ops.attn import HOPPER_KERNELS, MMA16_KERNEL_FILE

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the warpgroup kernels need a Hopper GPU")
    hopper, mma = (CudaEngine(precision=precision, hopper_kernels=h) for h in (True, False))
    assert HOPPER_KERNELS[MMA16_KERNEL_FILE][0] in hopper.k and HOPPER_KERNELS[MMA16_KERNEL_FILE][0] not in mma.k
    runs = [train_run(e, WIDE, micro_batch=3, n_micro=2, steps=3) for e in (hopper, mma)]  # head width 64
    assert runs[0].digest == runs[1].digest


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_attention_launch_orders_give_the_same_bits(engines, precision, monkeypatch):
    """kernels/attn_bf16.cu's two launch orders (andrea/ops/attn.py heads_first: each head's tiles together, or a
    tile rank across every head) compute the same tiles, so the same bits."""
    from andrea.ops import attn

    e = engines[precision]
    B, T, H = 3, 333, 5

    def orders():
        for first in (False, True):
            monkeypatch.setattr(attn, "heads_first", lambda heads, T, l2_bytes, first=first: first)
            assert attn.launch_order(B * H, T)[1] == first  # the launches take the order asked
            yield e

    assert_same_bits(*attention_bits(e, orders(), B=B, T=T, H=H))


@pytest.mark.parametrize("B, T, C", [(3, 64, 96), (5, 333, 96), (2, 100, 700)])
def test_the_embedding_backward_s_sort_gives_the_scan_s_bits(engines, B, T, C):
    """k_embed_bwd_sorted (the sorted keys' runs, built for the fewest columns a thread that cover C) against
    k_embed_bwd16 (the first-occurrence scan, built for the most) on fresh inputs with tokens that repeat: most a
    few times, token 7 at about 40% of the positions (at B 5 T 333 a run past one chunk of keys), into nonzero
    gradients: the same bytes, and dwte right against float64."""
    e = engines["fp32"]
    rng = np.random.default_rng()
    V = 300
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    tokens.reshape(-1)[rng.random(B * T) < 0.4] = 7
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    start = {"dwte": rng.standard_normal((V, C)).astype(np.float32), "dwpe": rng.standard_normal((T, C)).astype(np.float32)}
    dev = {k: e.xp.asarray(v) for k, v in {"tokens": tokens, "dout": dout}.items()}
    got = {}
    for way in ("sort", "scan"):
        g = {k: e.xp.asarray(v) for k, v in start.items()}
        if way == "sort":
            e.embed_bwd(g["dwte"], g["dwpe"], dev["dout"], dev["tokens"])
        else:
            e.launch("k_embed_bwd16", B * T + T, 256, g["dwte"], g["dwpe"], dev["dout"], dev["tokens"],
                     np.int64(B * T), np.int32(T), np.int32(C), np.int32(1))  # add_wpe: += as embed_bwd
        got[way] = {k: e.to_host(v) for k, v in g.items()}
    for k in start:
        assert np.array_equal(got["sort"][k].view(np.uint32), got["scan"][k].view(np.uint32)), k
    want = start["dwte"].astype(np.float64)
    np.add.at(want, tokens.reshape(-1), dout.reshape(-1, C).astype(np.float64))
    assert np.abs(got["sort"]["dwte"] - want).max() < 1e-3


@pytest.mark.parametrize("shape", [SHAPE, WIDE], ids=["tiny", "wide"])
def test_training_steps_match_numpy(engines, shape):
    from andrea.engines.numpy_engine import NumpyEngine

    ref = train_run(NumpyEngine(), shape, micro_batch=4, n_micro=2, steps=8)
    for precision, limit in (("fp32", 1e-4), ("tf32", 1e-2), ("bf16", 2e-2), ("fp16", 1e-2), ("fp8", 5e-2)):
        run = train_run(engines[precision], shape, micro_batch=4, n_micro=2, steps=8,
                        recompute=("gelu", "layernorm") if precision in ("bf16", "fp16", "fp8") else ())
        np.testing.assert_allclose(run.losses, ref.losses, rtol=limit, err_msg=precision)
        np.testing.assert_allclose(run.norms, ref.norms, rtol=10 * limit, err_msg=precision)


@pytest.mark.parametrize("recompute, layers", [(("gelu",), None), (("gelu", "layernorm"), None), (("gelu",), 1)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_changes_no_bit(engines, precision, recompute, layers):
    """Keeping one layer's MLP activations (and LayerNorm outputs) and recomputing them in the backward, in every
    layer or only the first, gives the same steps."""
    plain = train_run(engines[precision], WIDE, micro_batch=2, n_micro=2, steps=3)
    again = train_run(engines[precision], WIDE, micro_batch=2, n_micro=2, steps=3, recompute=recompute,
                      recompute_layers=layers)
    assert plain.digest == again.digest


@pytest.mark.parametrize("precision, rel", [("fp32", 1e-5), ("bf16", 1e-2)])
def test_loss_chunks_match_one_piece(engines, precision, rel):
    """The classifier in two pieces (3 sequences: 2 then 1): the same training up to the sum order of wte's
    gradient, and the same bits run to run."""
    whole = train_run(engines[precision], WIDE, micro_batch=3, n_micro=2, steps=4)
    pieces = [train_run(engines[precision], WIDE, micro_batch=3, n_micro=2, steps=4, loss_chunks=2) for _ in range(2)]
    np.testing.assert_allclose(pieces[0].losses, whole.losses, rtol=rel)
    assert pieces[0].digest == pieces[1].digest


@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_step_writes_its_gradient_whole(engines, precision):
    """Nothing zeroes the gradient between steps: each step's first micro-batch writes every element of it (the
    others add). NaN in grads before every step changes no bit, the classifier in two pieces."""
    runs = [train_run(engines[precision], WIDE, micro_batch=3, n_micro=2, steps=3, loss_chunks=2, poison_grads=poison)
            for poison in (False, True)]
    assert all(np.isfinite(run.losses).all() for run in runs)
    assert runs[0].digest == runs[1].digest


@pytest.mark.parametrize("precision", PRECISIONS)
def test_deterministic(engines, precision):
    first = train_run(engines[precision], WIDE, micro_batch=4, n_micro=2, steps=4)
    second = train_run(engines[precision], WIDE, micro_batch=4, n_micro=2, steps=4)
    assert first.digest == second.digest


@pytest.mark.parametrize("N, C", [(37, 40), (300, 128), (16384, 384)])  # odd, wide, 12M's MLP (which recomputes)
def test_the_recompute_s_forward_writes_act_alone_with_the_full_product_s_bits(engines, N, C):
    """Under `recompute: gelu` the forward writes act alone (cuBLASLt's GELU epilogue on the algorithm GELU_AUX
    runs) and the backward rebuilds pre and act with GELU_AUX: act of both has the same bits, and the forward
    leaves pre as it was."""
    e, rng = engines["bf16"], np.random.default_rng(np.random.SeedSequence().entropy)
    F = 4 * C
    inp, W_1, W_2 = (e.xp.zeros(shape, dtype="bfloat16") for shape in ((N, C), (C, F), (F, C)))
    e.upload(inp, rng.standard_normal((N, C)))
    e.upload(W_1, rng.standard_normal((C, F)) / C**0.5)
    e.upload(W_2, rng.standard_normal((F, C)) / F**0.5)
    out, alone_out = (e.xp.zeros((N, C), dtype="bfloat16") for _ in range(2))
    pre, act, alone_pre, alone_act = (e.xp.zeros((N, F), dtype="bfloat16") for _ in range(4))
    e.mlp_fwd(out, pre, act, inp, W_1, W_2)
    assert e.blas_lt.gemm(alone_act, inp, W_1, N, F, C, epilogue="gelu", aux=alone_pre)  # the epilogue alone runs
    e.zero(alone_act)
    e.mlp_fwd(alone_out, alone_pre, alone_act, inp, W_1, W_2, recompute=True)
    bits = lambda a: e.to_host(a).view(np.uint16)
    assert np.array_equal(bits(alone_act), bits(act)) and np.array_equal(bits(alone_out), bits(out))
    assert not bits(alone_pre).any()  # not written
    e._mlp_up(alone_pre, alone_act, inp, W_1)  # the backward's rebuild
    assert np.array_equal(bits(alone_pre), bits(pre)) and np.array_equal(bits(alone_act), bits(act))
    assert np.isfinite(e.to_host(act).astype(np.float32)).all() and e.to_host(act).astype(np.float32).any()


def test_gelu_epilogue_products_take_unaligned_buffers(engines):
    """Buffers 2 bytes past an aligned address (a plan's views can be): cuBLASLt is asked for algorithms that
    take that alignment (or the engine falls back to product + kernel); the MLP still matches float64."""
    from andrea.engines.numpy_engine import NumpyEngine

    e, rng = engines["bf16"], np.random.default_rng(np.random.SeedSequence().entropy)
    N, C = 37, 40
    F = 4 * C
    host = {"inp": rng.standard_normal((N, C)), "W_1": rng.standard_normal((C, F)) / C**0.5,
            "W_2": rng.standard_normal((F, C)) / F**0.5, "dout": rng.standard_normal((N, C))}
    host = {k: v.astype("bfloat16").astype(np.float64) for k, v in host.items()}

    def unaligned(shape, value=None):
        flat = e.xp.zeros(int(np.prod(shape)) + 1, dtype="bfloat16")
        a = flat[1:].reshape(shape)
        e.upload(a, np.full(shape, np.nan) if value is None else value)
        return a

    dev = {k: unaligned(v.shape, v) for k, v in host.items()}
    out, pre, act, dpre = (unaligned(s) for s in ((N, C), (N, F), (N, F), (N, F)))
    dinp = e.xp.zeros((N, C), dtype=np.float32)
    dW_1, dW_2 = e.xp.zeros((C, F), dtype=np.float32), e.xp.zeros((F, C), dtype=np.float32)
    e.mlp_fwd(out, pre, act, dev["inp"], dev["W_1"], dev["W_2"])
    e.mlp_bwd(dinp, dW_1, dW_2, dpre, dev["dout"], dev["inp"], pre, act, dev["W_1"], dev["W_2"], overwrite=True)
    ref = NumpyEngine("float64")
    r_out, r_pre, r_act, r_dpre = (np.zeros(x.shape) for x in (out, pre, act, dpre))
    r_dinp, r_dW_1, r_dW_2 = np.zeros((N, C)), np.zeros((C, F)), np.zeros((F, C))
    ref.mlp_fwd(r_out, r_pre, r_act, host["inp"], host["W_1"], host["W_2"])
    ref.mlp_bwd(r_dinp, r_dW_1, r_dW_2, r_dpre, host["dout"], host["inp"], r_pre, r_act, host["W_1"], host["W_2"])
    for name, got, want in (("out", out, r_out), ("act", act, r_act), ("dinp", dinp, r_dinp), ("dW_1", dW_1, r_dW_1)):
        got = e.to_host(got).astype(np.float64)
        assert np.linalg.norm(got - want) <= REL["bf16"] * np.linalg.norm(want), name


@pytest.mark.parametrize("n", [1, 1000, 16384])
def test_the_mean_loss_s_device_sums_are_the_host_s_mean(engines, n):
    """mean_loss on the device (k_loss_sums, float64) against the host's: to float64's rounding, a non-finite loss
    at a position of weight 0 left out, the same bits twice, and no target counting is refused."""
    import cupy

    from andrea.ops.loss import mean_loss

    e = engines["bf16"]
    rng = np.random.default_rng()
    losses = rng.uniform(0.0, 12.0, n).astype(np.float32)
    w = np.where(rng.random(n) < 0.3, 0.0, rng.uniform(0.0, 2.0, n)).astype(np.float32)
    w[0] = 0.0
    losses[0] = np.inf
    if n > 1:
        w[1] = 1.0
    dev_l, dev_w = cupy.asarray(losses), cupy.asarray(w)
    if n > 1:
        got = e.mean_loss(dev_l, dev_w)
        assert got == pytest.approx(mean_loss(losses, w), rel=1e-13) and got == e.mean_loss(dev_l, dev_w)
        losses[0] = 3.0
        assert e.mean_loss(cupy.asarray(losses)) == pytest.approx(mean_loss(losses), rel=1e-13)
    with pytest.raises(ValueError, match="no target counts"):
        e.mean_loss(dev_l, cupy.zeros_like(dev_w))


def test_staged_uploads_arrive_in_stream_order(engines):
    """A step's inputs go through pinned staging without the host waiting: each upload must land after the work
    queued before it and before the work queued after it, and must not be overwritten by the next upload to the same
    buffer while its copy is still queued behind a busy stream; the caller's array is free once upload returns."""
    import cupy

    e = engines["fp32"]
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    dst = cupy.full((64, 512), -7, dtype=np.int32)
    busy = cupy.asarray(rng.standard_normal((2048, 2048), dtype=np.float32))
    sources, seen = [], []
    for i in range(6):
        before = dst.copy()  # queued before the upload: must see the last upload's values (or the first fill)
        for _ in range(4):
            busy = busy @ busy * np.float32(1e-3)  # keep the stream busy so that the copy waits in the queue
        src = rng.integers(0, 50304, size=dst.shape, dtype=np.int64)
        e.upload(dst, src, staged=True)
        sources.append(src.astype(np.int32))
        src[...] = -1  # the caller's array is free once upload returns
        seen.append((before, dst.copy()))
    # more destinations than the engine keeps staging buffers for: each still gets its own values
    from andrea.engines.cuda_engine import STAGING_BUFFERS

    many = [cupy.zeros((8, 128), dtype=np.float32) for _ in range(STAGING_BUFFERS + 3)]
    many_src = [rng.standard_normal((8, 128)).astype(np.float32) for _ in many]
    for d, src in zip(many, many_src):
        busy = busy @ busy * np.float32(1e-3)
        e.upload(d, src, staged=True)
    e.synchronize()
    for i, (before, after) in enumerate(seen):
        expected_before = np.full(dst.shape, -7, np.int32) if i == 0 else sources[i - 1]
        np.testing.assert_array_equal(before.get(), expected_before, err_msg=f"seed {seed}: upload {i} came early")
        np.testing.assert_array_equal(after.get(), sources[i], err_msg=f"seed {seed}: upload {i} came late or wrong")
    for i, (d, src) in enumerate(zip(many, many_src)):
        np.testing.assert_array_equal(d.get(), src, err_msg=f"seed {seed}: destination {i} of {len(many)}")
    assert len(e._staging) <= STAGING_BUFFERS


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "masked"])
def test_train_step_allocates_nothing(engines, precision, weighted):
    """fp8 masked: the input gradient's fp32 scratch comes from the planned fp8_operands."""
    from andrea.schedule.model import Model, init_params

    model = Model(engines[precision], SHAPE, micro_batch=4)
    model.load_state(init_params(model.layout, 0))
    step_allocations(model, step=0, weighted=weighted)  # the first step uploads the decay ranges once
    counts = step_allocations(model, step=1, weighted=weighted)
    assert counts["pool_requests"] == 0, counts
    assert counts["used_before"] == counts["used_after"], counts


def test_plan_is_one_allocation(engines):
    import cupy

    from andrea.schedule.model import Model

    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    model = Model(engines["fp32"], SHAPE, micro_batch=4)
    grown = pool.used_bytes() - before
    # one allocation: the plan's bytes but the engine's own buffers (held since the engine started), each
    # buffer padded to 256 bytes, rounded up by the pool (512)
    carved = model.plan.total_bytes - engines["fp32"].own_bytes
    assert {b.name for b in engines["fp32"].traits.own_buffers} <= {b.name for b in model.plan.buffers}
    assert carved <= grown <= carved + 256 * len(model.plan.buffers) + 512


def test_unknown_precision_is_refused():
    from andrea.engines.cuda_engine import CudaEngine

    with pytest.raises(AndreaError, match="int4"):
        CudaEngine(precision="int4")


def test_fp16_overflow_skips_the_step_and_halves_the_scale(engines):
    """A loss scale far too large overflows fp16: no update, the scale halved; the next step trains as if the
    overflowed one had not run (its gradient, left in grads, is written over)."""
    from andrea.schedule.crosscheck import OPTIMIZER, lr_at, synthetic_micro_batches
    from andrea.schedule.model import LossScaleOverflow, Model, init_params

    def good_step(model):
        model.loss_scale.scale = 2.0**10
        loss, norm = model.train_step(synthetic_micro_batches(WIDE, 2, 1, 0), step=0, lr=lr_at(0), optimizer=OPTIMIZER)
        assert np.isfinite(loss) and np.isfinite(norm) and model.loss_scale.good_steps == 1

    # the step alone first, in a model of its own (the engine keeps one model's W_QKV copies: one model at a time)
    alone = Model(engines["fp16"], WIDE, micro_batch=2)
    start = init_params(alone.layout, 0)
    alone.load_state(start)
    good_step(alone)
    want = alone.host_state()
    del alone
    model = Model(engines["fp16"], WIDE, micro_batch=2)
    model.load_state(start)
    model.loss_scale.scale = 2.0**60
    with pytest.raises(LossScaleOverflow):
        model.train_step(synthetic_micro_batches(WIDE, 2, 1, 0), step=0, lr=lr_at(0), optimizer=OPTIMIZER)
    assert model.loss_scale.scale == 2.0**59
    params, m, v = model.host_state()
    assert np.array_equal(params, start) and not m.any() and not v.any()
    good_step(model)
    assert not np.array_equal(model.host_state()[0], start)
    for got, expected in zip(model.host_state(), want):
        assert np.array_equal(got, expected)
