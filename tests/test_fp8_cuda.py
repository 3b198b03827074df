"""Precision fp8 on the GPU: the casts' and kernels' bytes against the NumPy reference (andrea/ops/fp8.py), the FP8
products against float64 on the same FP8 operands, and the engine's shortcuts (the weight copies, amaxes found once
a pass, saved transposes, outputs written as FP8 bytes only) and fallbacks (FP8 products off inside a pass, no FP8
algorithm) against the plain path's bits. One engine for the module."""

import contextlib

import numpy as np
import pytest

from andrea.ops import fp8
from conftest import fp8_history_row


FORMATS = list(fp8.FORMATS)


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
    d = engine.fp8_book.cast(engine_x, rows, cols, fmt, 0, q=q, ldq=ldq, q_batch=cols, qt=qt, ldqt=ldqt,
                         qt_batch=cols * ldqt, batch=batch)
    got_q = cupy.asnumpy(q).reshape(rows, ldq)
    got_qt = cupy.asnumpy(qt).reshape(batch, cols, ldqt)
    for z in range(batch):
        assert np.array_equal(got_q[:, z * cols:(z + 1) * cols], want[z]), z
        assert np.array_equal(got_qt[z, :, :rows], want[z].T), z
    assert np.all(got_q[:, batch * cols:] == 0xA5) and np.all(got_qt[:, :, rows:] == 0xA5)
    assert float(cupy.asnumpy(d)[0]) == descale


@pytest.mark.gpu
@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("N, F, over", [(256, 512, False), (100, 72, False), (70, 70, False), (100, 72, True)])
def test_the_dgelu_cast_applies_gelu_s_gradient_and_casts_at_the_bound_s_scale(engine, N, F, over, store):
    """k_fp8_cast_dgelu writes E5M2 dpre and dpre^T with the reference's bytes, at dgelu_amax's scale, of dpre *
    GELU'(pre) as the plain GELU gradient pass (k_mlp_bwd) stores it, and its descale; with `store` it stores those
    values too, without it leaves dpre as it was. Ragged tiles and rows with no 16-byte loads (F 70) too; `over`:
    values past the bound (which a product's never are) saturate as the reference's."""
    import cupy

    rng = np.random.default_rng()
    C = 96
    sd_host, sw_host = 2.0 ** -int(rng.integers(10, 30)), 2.0 ** -int(rng.integers(4, 12))
    bound = fp8.dgelu_amax(C, sd_host, sw_host)
    raw = _bf16(rng.standard_normal((N, F)) * bound * 10.0 ** (1 if over else rng.uniform(-6, -1)))
    pre = _bf16(rng.standard_normal((N, F)) * 2)
    plain, fused = cupy.asarray(raw.astype("bfloat16")), cupy.asarray(raw.astype("bfloat16"))
    dev_pre = cupy.asarray(pre.astype("bfloat16"))
    engine._gelu_grad(plain, dev_pre)
    sd, sw = (cupy.asarray(np.array([v, 0, 0, 0], dtype=np.float32)) for v in (sd_host, sw_host))
    dq, dt = cupy.full(N * F, 0xA5, dtype=np.uint8), cupy.full(N * F, 0xA5, dtype=np.uint8)
    descale = engine._fp8_cast_dgelu(fused, dev_pre, N, F, C, sd[:1], sw[:1], dq, dt, store)
    stored = cupy.asnumpy(plain)
    assert np.array_equal(cupy.asnumpy(fused).view(np.uint16), (stored if store else raw.astype("bfloat16")).view(np.uint16))
    want, want_descale = fp8.quantize(stored.astype(np.float32), "e5m2", bound)
    assert (np.abs(fp8.dequantize(want, want_descale, "e5m2")) == 57344 * want_descale).any() == over
    assert np.array_equal(cupy.asnumpy(dq).reshape(N, F), want)
    assert np.array_equal(cupy.asnumpy(dt).reshape(F, N), want.T)
    assert float(cupy.asnumpy(descale)[0]) == want_descale


@pytest.mark.gpu
@pytest.mark.parametrize("plain_dW_1", [False, True])
def test_leaving_dpre_unwritten_changes_no_other_bit(engine, monkeypatch, plain_dW_1):
    """mlp_bwd with keep_dpre False (the model's) gives the bytes of keep_dpre True in every other output; dpre is
    left as the product wrote it. With dW_1's FP8 product unavailable (`plain_dW_1`), its plain product reads dpre
    finished by the GELU gradient pass: again the same bytes."""
    import cupy

    rng = np.random.default_rng()
    N, C = 128, 64
    F = 4 * C
    host = {"inp": rng.standard_normal((N, C)), "W_1": rng.standard_normal((C, F)) * C**-0.5,
            "W_2": rng.standard_normal((F, C)) * F**-0.5, "dout": rng.standard_normal((N, C)) * 1e-3}
    dev = {k: cupy.asarray(v.astype("bfloat16")) for k, v in host.items()}
    if plain_dW_1:
        gemm = fp8.Fp8Book.gemm
        monkeypatch.setattr(fp8.Fp8Book, "gemm", lambda self, c, *a, **k: (
            False if c.shape == (C, F) else gemm(self, c, *a, **k)))

    def run(keep_dpre):
        out, pre, act, dpre = (cupy.full(s, np.nan, dtype="bfloat16") for s in ((N, C), (N, F), (N, F), (N, F)))
        dinp = cupy.full((N, C), np.nan, dtype=np.float32)
        dW_1, dW_2 = cupy.zeros((C, F), dtype=np.float32), cupy.zeros((F, C), dtype=np.float32)
        engine.mlp_fwd(out, pre, act, dev["inp"], dev["W_1"], dev["W_2"])
        engine.mlp_bwd(dinp, dW_1, dW_2, dpre, dev["dout"], dev["inp"], pre, act, dev["W_1"], dev["W_2"],
                       overwrite=True, keep_dpre=keep_dpre)
        return {k: cupy.asnumpy(v).view(np.uint8) for k, v in (("dinp", dinp), ("dW_1", dW_1), ("dW_2", dW_2),
                                                               ("dpre", dpre), ("pre", pre))}

    kept, left = run(True), run(False)
    for k in ("dinp", "dW_1", "dW_2"):
        assert np.array_equal(kept[k], left[k]), k
    assert np.isfinite(kept["dpre"].view("bfloat16").astype(np.float32)).all()
    if not plain_dW_1:
        assert not np.array_equal(kept["dpre"], left["dpre"])  # the product's dout @ W_2^T, GELU' not applied


@pytest.mark.gpu
def test_fp8_products_equal_float64_on_the_same_fp8_operands(engine):
    """The FP8 linear products (the MLP's, `linear_fwd` / `linear_bwd`) and attn_qkv forward and backward in fp8
    against float64 products of the reference's FP8 operands (what the engine multiplies), to bf16's rounding of
    the outputs; the same products against the exact float64 ones are a few per cent off (the FP8 rounding
    itself). attn_out's products stay bf16 under fp8: the bits of precision bf16's."""
    import cupy

    from andrea.engines.cuda_engine import CudaEngine

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
    engine.linear_fwd(out, dev["x"], dev["W"], N, C, C)
    dW = cupy.asarray(dW0)
    dinp = cupy.full((N, C), np.nan, dtype=np.float32)
    engine.linear_bwd(dinp, dW, dev["dout"], dev["x"], dev["W"], N, C, C, 0.0)
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

    attn_out = []  # out, dinp, dW of attn_out under fp8, then under bf16
    for e in (engine, CudaEngine(precision="bf16")):
        o, d, g = (cupy.full((N, C), np.nan, dtype="bfloat16"), cupy.full((N, C), np.nan, dtype=np.float32),
                   cupy.asarray(dW0))
        e.attn_out_fwd(o, dev["x"], dev["W"])
        e.attn_out_bwd(d, g, dev["dout"], dev["x"], dev["W"], overwrite=True)
        attn_out.append([cupy.asnumpy(a) for a in (o, d, g)])
    fp8_bits, bf16_bits = attn_out
    for a, b in zip(fp8_bits, bf16_bits):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))

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
@pytest.mark.parametrize("weighted", [False, True])
def test_the_classifier_s_fp8_products_equal_float64_on_the_same_fp8_operands(engine, weighted):
    """The logits on E4M3 x and wte, and the input gradient d_logits wte on the E5M2 d_logits that the forward's
    softmax wrote (at amax 1's scale), against float64 products of the reference's FP8 operands, to bf16's
    rounding; wte's gradient in bf16. Weighted (some weights 0), the same FP8 product with each row then scaled by
    its weight (the forward's copy is unweighted). Against the exact products the FP8 ones are off by more."""
    import cupy

    from andrea.spec.config import ModelShape
    from andrea.schedule.model import Model

    B, T, C, V = 2, 64, 128, 512
    N, scale = B * T, 1.0 / (B * T)
    Model(engine, ModelShape(n_layer=1, d_model=C, n_head=2, vocab_size=V, seq_len=T), B)  # holds fp8_dlogits
    rng = np.random.default_rng()
    x = _bf16(rng.standard_normal((N, C)))
    wte = _bf16(rng.standard_normal((V, C)) * 2 * C**-0.5)
    targets = rng.integers(0, V, N).astype(np.int32)
    w = np.where(rng.random(N) < 0.25, 0.0, rng.uniform(0.2, 2.0, N)).astype(np.float32) if weighted else None
    dwte0 = rng.standard_normal((V, C)).astype(np.float32)
    dev_x, dev_wte = (cupy.asarray(a.astype("bfloat16")) for a in (x, wte))
    losses = cupy.full(N, np.nan, dtype=np.float32)
    probs = cupy.full((N, V), np.nan, dtype="bfloat16")
    engine.loss_fwd(losses, probs, dev_x, dev_wte, cupy.asarray(targets))
    got_probs = cupy.asnumpy(probs).astype(np.float64)
    dinp, dwte = cupy.full((N, C), np.nan, dtype="bfloat16"), cupy.asarray(dwte0)  # the model's d_ln
    engine.loss_bwd(dinp, dwte, probs, dev_x, dev_wte, cupy.asarray(targets), scale, overwrite=True,
                    weights=None if w is None else cupy.asarray(w))

    def deq(a, fmt):
        return fp8.dequantize(*fp8.quantize(a, fmt), fmt)

    def softmax(logits):
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    onehot = np.eye(V)[targets]
    logits = _bf16(deq(x, "e4m3") @ deq(wte, "e4m3").T).astype(np.float64)  # the product's bf16 output
    p = softmax(logits)
    d_bf16 = _bf16(got_probs - onehot if w is None else w[:, None] * (got_probs - onehot)).astype(np.float64)
    d = fp8.fake_quantize(np, (p - onehot).astype(np.float32), "e5m2", fp8.DLOGITS_AMAX).astype(np.float64)
    want_dinp = scale * d @ deq(wte, "e4m3")
    if w is not None:
        want_dinp *= w[:, None]
    want = {"probs": p, "losses": np.log(np.exp(logits).sum(-1)) - logits[np.arange(N), targets],
            "dinp": want_dinp, "dwte": scale * d_bf16.T @ x}
    got = {"probs": got_probs, "losses": cupy.asnumpy(losses), "dinp": cupy.asnumpy(dinp).astype(np.float64),
           "dwte": cupy.asnumpy(dwte) - dwte0}
    for k in want:
        rel = np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])
        assert rel <= 1e-2, (k, rel)
    exact_p = softmax(x.astype(np.float64) @ wte.T)
    exact_dinp = scale * (exact_p - onehot if w is None else w[:, None] * (exact_p - onehot)) @ wte
    assert np.linalg.norm(got["probs"] - exact_p) / np.linalg.norm(exact_p) > 5e-3
    off = np.linalg.norm(got["dinp"] - exact_dinp) / np.linalg.norm(exact_dinp)
    assert off > 5e-3, off
    if w is not None:  # the rows of weight 0 are exact zeros
        assert not got["dinp"][w == 0].any()


@pytest.mark.gpu
def test_the_weight_copies_in_two_launches_are_the_casts_one_at_a_time(engine):
    """prepare_fp8_weights' table-driven launches write every copy byte and descale of the per-matrix casts, odd
    shapes (tiles cut by the edges) and the vocabulary included, and leave each slot's amax word and flag at zero
    (for the next AdamW step)."""
    import cupy

    from andrea.spec.config import ModelShape
    from andrea.schedule.model import Model, init_params
    from andrea.ops.base import ptr

    model = Model(engine, ModelShape(n_layer=2, d_model=80, n_head=5, vocab_size=301, seq_len=32), 2)
    model.load_state(init_params(model.layout, 3))
    b, W = model.buf, model.W
    casts, _, table, slots = fp8._weight_casts(b["params_fp8"], W["layers"], W["wte"])
    copies_end = ptr(table) - ptr(b["params_fp8"])
    many = cupy.asnumpy(b["params_fp8"])
    b["params_fp8"][:copies_end].fill(0)  # as allocated (the pads between copies are never written)
    slots.fill(0)
    for M, rows, cols, cast in casts:
        engine.fp8_book.cast(M, rows, cols, "e4m3", **cast, keep=False)
    one_by_one = cupy.asnumpy(b["params_fp8"])
    assert np.array_equal(many[:copies_end], one_by_one[:copies_end])
    tail = ptr(slots) - ptr(b["params_fp8"])
    many_slots, own_slots = (x[tail:].view(np.float32).reshape(-1, fp8.SLOT_FLOATS) for x in (many, one_by_one))
    assert np.array_equal(many_slots[:, 0], own_slots[:, 0]) and (own_slots[:, 0] > 0).all()  # the descales
    assert not many_slots[:, 1:3].any() and own_slots[:, 1].all()
    assert np.any(many[:copies_end] != 0)


@pytest.mark.gpu
def test_adamw_takes_the_weight_copies_amax_for_their_casts(engine):
    """Under fp8 AdamW takes the amax of each matrix's bf16 copy as it writes it (and, where its gate says no, of
    the copy as it is), and flags it; prepare_fp8_weights then skips its own amax pass for those matrices: the FP8
    copies and descales are the bytes of the per-matrix casts, each with its own amax pass, and every amax word and
    flag is back at zero."""
    import cupy

    from andrea.spec.config import ModelShape
    from andrea.schedule.model import Model, init_params
    from andrea.ops.base import ptr

    model = Model(engine, ModelShape(n_layer=2, d_model=80, n_head=5, vocab_size=301, seq_len=32), 2)
    model.load_state(init_params(model.layout, 4))
    b, W = model.buf, model.W
    casts, _, table, slots = fp8._weight_casts(b["params_fp8"], W["layers"], W["wte"])
    copies_end, tail = ptr(table) - ptr(b["params_fp8"]), ptr(slots) - ptr(b["params_fp8"])
    rng = np.random.default_rng()
    for step, opens in ((1, True), (2, False), (3, True)):
        engine.upload(b["grads"], rng.standard_normal(b["grads"].size).astype(np.float32))
        before = cupy.asnumpy(b["params"])
        gate = cupy.asarray(np.array([0.5, 1.0 if opens else 0.0], dtype=np.float32))
        engine.adamw_step(b["params"], b["grads"], b["m"], b["v"], lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.1, step=step, decay_ranges=model.layout.decay_ranges(),
                          params_lp=b["params_lp"], gate=gate)
        assert np.any(cupy.asnumpy(b["params"]) != before) == opens
        words = cupy.asnumpy(slots).reshape(-1, fp8.SLOT_FLOATS)
        for j, (M, *_) in enumerate(casts):
            assert words[j, 1] == np.abs(cupy.asnumpy(M).astype(np.float32)).max() and words[j, 2] == 1.0, j
        model.weights_changed()
        prepared = cupy.asnumpy(b["params_fp8"])
        b["params_fp8"][:copies_end].fill(0)
        slots.fill(0)
        for M, rows, cols, cast in casts:
            engine.fp8_book.cast(M, rows, cols, "e4m3", **cast, keep=False)
        one_by_one = cupy.asnumpy(b["params_fp8"])
        assert np.array_equal(prepared[:copies_end], one_by_one[:copies_end])
        mine, own = (x[tail:].view(np.float32).reshape(-1, fp8.SLOT_FLOATS) for x in (prepared, one_by_one))
        assert np.array_equal(mine[:, 0], own[:, 0]) and not mine[:, 1:3].any()
        b["params_fp8"].set(prepared)  # as the step left it: amax words and flags at zero


@pytest.mark.gpu
def test_prepared_weight_copies_change_no_bit(engine, monkeypatch):
    """Training with the model's FP8 weight copies (cast once per weight update) and with every op casting its
    weights itself gives the same bytes: the copies are fresh after every AdamW step and every load."""
    from andrea.spec.config import ModelShape
    from andrea.schedule.crosscheck import train_run

    shape = ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=512, seq_len=64)
    prepared = train_run(engine, shape, micro_batch=4, n_micro=2, steps=4)
    assert engine.fp8_book._weights  # the copies were in use
    monkeypatch.setattr(type(engine), "prepare_fp8_weights", lambda self, *a: setattr(self.fp8_book, "_weights", {}))
    per_call = train_run(engine, shape, micro_batch=4, n_micro=2, steps=4)
    assert prepared.digest == per_call.digest


@pytest.mark.gpu
@pytest.mark.parametrize("d_model, n_head, recompute", [(64, 4, ()), (64, 4, ("layernorm", "gelu")), (1040, 20, ())])
def test_amaxes_found_once_a_pass_change_no_bit(engine, monkeypatch, d_model, n_head, recompute):
    """Training with the pass's kept amaxes (the LayerNorms' and the GELU gradient's own, the forward's reused by
    the backward) and with every cast running its own amax pass gives the same bytes, with far fewer passes:
    each scale is the same function of the same tensor. d_model 1040 takes the LayerNorm backward's wide-row
    kernel, the recompute options the shared scratch buffers. Without the act history (which casts act at its
    scale inside a pass, and at its own amax's outside one) and the LayerNorms' E4M3 outputs (at their bound's
    scale inside a pass), so that act's and the LayerNorm outputs' casts are in the comparison too. In a pass no
    amax word is zeroed by a memset of its own (the pass's table is zeroed once as it opens)."""
    from andrea.spec.config import ModelShape
    from andrea.schedule.crosscheck import train_run

    _without_act_history(engine, monkeypatch)
    _without_e4m3_layernorms(monkeypatch)

    shape = ModelShape(n_layer=2, d_model=d_model, n_head=n_head, vocab_size=512, seq_len=64)
    launches, preparing = [], []
    launch, prepare = type(engine).launch, type(engine).prepare_fp8_weights

    def counted(self, name, *a):  # the amax passes of the micro-batches, not of the weight copies'
        if not preparing:
            launches.append(name)
        return launch(self, name, *a)

    zero = type(engine).zero

    def zero_counted(self, buf):  # an amax word alone: a memset for one cast or producer
        if not preparing and buf.size == 1:
            launches.append("zero one word")
        return zero(self, buf)

    def prepare_weights(self, *a):
        preparing.append(1)
        try:
            return prepare(self, *a)
        finally:
            preparing.clear()

    monkeypatch.setattr(type(engine), "launch", counted)
    monkeypatch.setattr(type(engine), "zero", zero_counted)
    monkeypatch.setattr(type(engine), "prepare_fp8_weights", prepare_weights)

    def run():
        launches.clear()
        r = train_run(engine, shape, micro_batch=4, n_micro=2, steps=3, recompute=recompute, loss_chunks=2)
        return r, launches.count("k_fp8_amax")

    kept, kept_passes = run()
    assert launches.count("zero one word") == 0

    monkeypatch.setattr(type(engine), "fp8_pass", lambda self, backward=True: contextlib.nullcontext())
    own, own_passes = run()
    assert launches.count("zero one word") > 0  # outside a pass each amax pass zeroes its word
    assert kept.digest == own.digest, (kept.losses, own.losses)
    assert kept_passes < own_passes / 2, (kept_passes, own_passes)


def _without_e4m3_layernorms(monkeypatch) -> None:
    """Models and ops from here to the test's end write the LayerNorm outputs in bf16, cast by the products."""
    from andrea.ops import layernorm

    monkeypatch.setattr(layernorm, "writes_e4m3", lambda rows, C: False)


def _without_act_history(engine, monkeypatch) -> None:
    """Models made on `engine` from here to the test's end keep no act history (act cast at its own amax)."""
    import dataclasses

    monkeypatch.setattr(engine, "traits", dataclasses.replace(engine.traits, fp8_histories=False))


@pytest.mark.gpu
@pytest.mark.parametrize("history, e4m3_lns", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("recompute, recompute_layers", [((), None), (("gelu",), 1), (("gelu",), None),
                                                         (("layernorm",), 1), (("layernorm", "gelu"), None)])
def test_the_saved_transposes_change_no_bit(engine, monkeypatch, recompute, recompute_layers, history, e4m3_lns):
    """The X^T that the forward's casts save into fp8_act_t (the MLP's act for dW_2, the two LayerNorm outputs
    for dW_QKV and dW_1) and the backward's products read give the bytes of casting X again in the backward,
    with one cast fewer for each saved X a backward call reads (calls on the host: a recorded micro-batch
    replays without any); the layers that rebuild X (recompute gelu, layernorm) cast it again. The plan holds a
    place for each kept X and the one LayerNorm buffer that the rebuilding layers share. With the act history,
    act^T lives in act's own bytes: no place for it, and no cast of act either way; with the LayerNorms writing
    E4M3 (ops/layernorm.py), so do their outputs' X^T, the rebuilt ones' too."""
    from andrea.spec.config import ModelShape
    from andrea.schedule.crosscheck import train_run

    if not history:
        _without_act_history(engine, monkeypatch)
    if not e4m3_lns:
        _without_e4m3_layernorms(monkeypatch)
    shape = ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=512, seq_len=64)
    L = shape.n_layer
    r = recompute_layers or L
    kept_acts = 0 if history else L - (r if "gelu" in recompute else 0)
    # layers that keep their two LayerNorm outputs' X^T in fp8_act_t
    kept_lns = 0 if e4m3_lns else L - (r if "layernorm" in recompute else 0)
    calls = {"cast": 0, "mlp_bwd": 0}
    for name, owner in (("cast", fp8.Fp8Book), ("mlp_bwd", type(engine))):
        def counted(self, *a, _name=name, _method=getattr(owner, name), **k):
            calls[_name] += 1
            return _method(self, *a, **k)
        monkeypatch.setattr(owner, name, counted)

    def run():
        for name in calls:
            calls[name] = 0
        engine.fp8_book._act_t_places.clear()  # a fresh model's buffers
        r = train_run(engine, shape, micro_batch=4, n_micro=2, steps=3, recompute=recompute,
                      recompute_layers=recompute_layers)
        return r, dict(calls)

    saved, saved_calls = run()
    shared_ln = not e4m3_lns and kept_lns < L  # the one LayerNorm buffer of the layers that rebuild theirs
    assert len(engine.fp8_book._act_t_places) == kept_acts + 2 * kept_lns + shared_ln
    from andrea.schedule.model import Model

    plan = Model(engine, shape, 4, recompute=recompute, recompute_layers=recompute_layers).plan
    N, C = 4 * shape.seq_len, shape.d_model
    want = kept_acts * fp8._padded(N * 4 * C) + (2 * kept_lns + shared_ln) * fp8._padded(N * C)
    held = {b.name: b for b in plan.buffers}.get("fp8_act_t")
    assert (0 if held is None else held.shape[0]) == want
    monkeypatch.setattr(fp8.Fp8Book, "_transpose_place", lambda self, x: None)
    again, again_calls = run()
    assert saved.digest == again.digest, (saved.losses, again.losses)
    assert saved_calls["mlp_bwd"] == again_calls["mlp_bwd"] > 0
    backwards = saved_calls["mlp_bwd"] // L  # host runs of a whole backward
    fewer = again_calls["cast"] - saved_calls["cast"]
    assert fewer == backwards * (kept_acts + 2 * kept_lns), (again_calls, saved_calls)


@pytest.mark.gpu
def test_a_forward_alone_saves_nothing_for_a_backward(engine, monkeypatch):
    """Model.forward (evaluation, in the training model's memory) writes neither the classifier's E5M2 d_logits
    nor the LayerNorm outputs' transposes (in fp8_act_t or in their own bytes), which only a backward reads; its loss is the bits of the training pass's
    forward without an act history (act at its own amax: as an evaluation of the checkpoint in a new process), and
    that pass writes both."""
    import cupy

    from andrea.spec.config import ModelShape
    from andrea.schedule.crosscheck import synthetic_micro_batches
    from andrea.schedule.model import Model, init_params

    shape = ModelShape(n_layer=2, d_model=64, n_head=4, vocab_size=512, seq_len=64)
    tokens, targets = synthetic_micro_batches(shape, 4, 1, 0, 5)[0]

    def run():  # (the forward's loss, the training pass's)
        model = Model(engine, shape, 4)
        model.load_state(init_params(model.layout, 5))
        planned = {b.name for b in model.plan.buffers}
        held = [engine.own[k] for k in ("fp8_dlogits", "fp8_act_t") if k in planned]
        # the LayerNorm outputs' second halves: X^T where the LayerNorms write E4M3 (ops/layernorm.py)
        held += [fp8.fp8_halves(model.saved(name, 0))[1] for name in ("ln1", "ln2")]
        for h in held:
            h.fill(0x5A)

        def untouched():
            return [bool((cupy.asnumpy(h) == 0x5A).all()) for h in held]

        loss = model.forward(tokens, targets)
        assert untouched() == [True] * len(held)
        losses = loss, model.forward_backward(tokens, targets)
        assert untouched() == [False] * len(held)
        return losses

    with monkeypatch.context() as m:
        _without_act_history(engine, m)
        plain = run()
    delayed = run()
    # a forward alone casts act at its own amax, with an act history or without; the training pass's forward at
    # the history's scale where there is one (its first pass: the scale 1)
    assert plain[0] == plain[1] == delayed[0] != delayed[1]
    assert abs(delayed[1] / delayed[0] - 1) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("rows, cols", [(128, 192), (100, 72), (37, 24), (64, 64), (520, 80), (1024, 64)])
def test_the_act_transpose_and_the_history_fold_are_the_reference_s(engine, rows, cols):
    """k_fp8_act_t: every byte of q^T, in ragged tiles and without 16-byte accesses; its fold of a row (random
    history, amax and scale) the reference's fold_amax, every float, for the act history's E4M3 and dqkv's E5M2."""
    import cupy

    rng = np.random.default_rng()
    q = rng.integers(0, 256, rows * cols, dtype=np.uint8)
    for name, (fmt, _) in fp8.HISTORIES.items():
        row = fp8_history_row(rng.uniform(0.01, 100.0, rng.integers(1, 40)), name)
        row[fp8.history_field("AMAX")] = rng.uniform(0.01, 300.0)
        want = row.copy()
        fp8.fold_amax(want, float(row[fp8.history_field("AMAX")]), fmt)
        dq, dqt, drow = cupy.asarray(q), cupy.full(rows * cols, 0xA5, dtype=np.uint8), cupy.asarray(row)
        d = fp8.kernel_defines("fp8")
        grid = fp8.act_t_grid(rows, cols)
        engine.k["k_fp8_act_t"](grid, (d["FP8_THREADS"],), (dq, dqt, np.int32(rows), np.int32(cols), drow,
                                                            np.int32(fp8.FORMATS[fmt][0])))
        np.testing.assert_array_equal(cupy.asnumpy(dqt).reshape(cols, rows), q.reshape(rows, cols).T)
        np.testing.assert_array_equal(cupy.asnumpy(drow), want)


@pytest.mark.gpu
@pytest.mark.parametrize("N, C", [(128, 64), (208, 48)])
def test_the_mlp_writes_act_in_e4m3_at_the_history_s_scale(engine, N, C):
    """In a training pass with a history row the GELU_AUX product writes act itself in E4M3 at the row's scale
    (values past it saturate), act^T beside it, the pass is folded into the row as the reference folds it, and
    the products that read act take this pass's descale: out and dW_2 against float64 products of those bytes,
    dinp and dW_1 (which do not read act) as the current scaling's. A recompute gives the same bytes."""
    import cupy

    rng = np.random.default_rng()
    F = 4 * C
    host = {"inp": _bf16(rng.standard_normal((N, C))), "W_1": _bf16(rng.standard_normal((C, F)) * C**-0.5),
            "W_2": _bf16(rng.standard_normal((F, C)) * F**-0.5), "dout": _bf16(rng.standard_normal((N, C)) * 1e-3)}
    dev = {k: cupy.asarray(v.astype("bfloat16")) for k, v in host.items()}
    deq = {k: fp8.dequantize(*fp8.quantize(host[k], "e4m3"), "e4m3") for k in ("inp", "W_1", "W_2")}
    pre_ref = deq["inp"] @ deq["W_1"]
    act_ref = 0.5 * pre_ref * (1 + np.tanh(np.sqrt(2 / np.pi) * (pre_ref + 0.044715 * pre_ref**3)))
    # a history whose scale saturates act's largest values: 448 / s lies in [h, 2 h) for a history amax h (the
    # largest power of two s with h s <= 448), so h at 45% of act's amax puts it under 90% of that amax
    start = fp8_history_row([0.45 * float(np.abs(act_ref).max())])
    s = float(start[fp8.history_field("SCALE")])

    def run(row, recompute=False):
        out, pre, act, dpre = (cupy.full(sh, np.nan, dtype="bfloat16") for sh in ((N, C), (N, F), (N, F), (N, F)))
        dinp = cupy.full((N, C), np.nan, dtype=np.float32)
        dW_1, dW_2 = cupy.full((C, F), np.nan, dtype=np.float32), cupy.full((F, C), np.nan, dtype=np.float32)
        drow = None if row is None else cupy.asarray(row)
        if drow is not None:
            drow[fp8.history_field("AMAX")] = 1e30  # the product writes the amax, whatever the word held
        with engine.fp8_pass():
            engine.mlp_fwd(out, pre, act, dev["inp"], dev["W_1"], dev["W_2"], recompute=recompute, act_history=drow)
            if recompute:
                for b in (pre, act):
                    b.fill(np.nan)
            engine.mlp_bwd(dinp, dW_1, dW_2, dpre, dev["dout"], dev["inp"], pre, act, dev["W_1"], dev["W_2"],
                           recompute=recompute, overwrite=True, overwrite_weights=True, keep_dpre=False,
                           act_history=drow)
        got = {k: cupy.asnumpy(v) for k, v in (("out", out), ("dinp", dinp), ("dW_1", dW_1), ("dW_2", dW_2))}
        got["bytes"] = cupy.asnumpy(act).reshape(-1).view(np.uint8)
        return got, None if drow is None else cupy.asnumpy(drow)

    current, _ = run(None)
    delayed, row = run(start.copy())
    again, row_again = run(start.copy(), recompute=True)
    q, qt = delayed["bytes"][:N * F].reshape(N, F), delayed["bytes"][N * F:].reshape(F, N)
    np.testing.assert_array_equal(qt, q.T)
    act = fp8.dequantize(q, 1.0 / s, "e4m3")
    largest = fp8.FORMATS["e4m3"][1] / s
    assert np.isclose(np.abs(act).max(), largest) and (np.abs(act_ref) > largest).any()  # saturated, no NaN
    near = np.abs(act - np.clip(act_ref, -largest, largest))
    assert (near <= 0.07 * np.abs(act_ref) + 2.0**-9 / s + 1e-2 * np.abs(act_ref).max() * 2.0**-6).all()
    want, amax = start.copy(), float(row[fp8.history_field("PAST") + int(start[fp8.history_field("AT")])])
    fp8.fold_amax(want, amax, "e4m3")
    np.testing.assert_array_equal(row, want)
    assert abs(amax / np.abs(act_ref).max() - 1) < 2e-2
    dout = fp8.dequantize(*fp8.quantize(host["dout"], "e5m2"), "e5m2")
    for k, ref in (("out", act @ deq["W_2"]), ("dW_2", act.T @ dout)):
        rel = np.linalg.norm(delayed[k] - ref) / np.linalg.norm(ref)
        assert rel <= 1e-2, (k, rel)
    for k in ("dinp", "dW_1"):
        rel = np.linalg.norm(delayed[k] - current[k]) / np.linalg.norm(current[k])
        assert rel <= 1e-2, (k, rel)
    for k in ("out", "dinp", "dW_1", "dW_2"):
        np.testing.assert_array_equal(again[k].view(np.uint8), delayed[k].view(np.uint8))
    # the same row, but for the amax word: the recompute's product wrote act's amax again, after the fold
    assert row_again[fp8.history_field("AMAX")] == amax
    row_again[fp8.history_field("AMAX")] = 0.0
    np.testing.assert_array_equal(row_again, row)


def _mlp_operands(rng, N, C):
    """An MLP's inputs in bf16 from fresh random values: inp [N, C], W_1, W_2 and a gradient dout [N, C]."""
    import cupy

    F = 4 * C
    return {k: cupy.asarray(_bf16(rng.standard_normal(shape) * scale).astype("bfloat16")) for k, shape, scale in (
        ("inp", (N, C), 1.0), ("W_1", (C, F), C**-0.5), ("W_2", (F, C), F**-0.5), ("dout", (N, C), 1e-3))}


def _no_fp8_algorithm_for(engine, monkeypatch, out) -> None:
    """engine's FP8 products find no algorithm for the product that writes `out` (as cuBLASLt may for a shape)."""
    fp8_gemm = engine.fp8_book.gemm
    monkeypatch.setattr(engine.fp8_book, "gemm", lambda c, *a, **k: c.data.ptr != out.data.ptr and fp8_gemm(c, *a, **k))


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True])
def test_a_backward_with_fp8_turned_off_reads_act_in_bf16_after_an_e4m3_forward(engine, monkeypatch, recompute):
    """A forward that wrote act as E4M3 bytes (the act history's path), then the backward with FP8 products off
    inside the same pass: act's bf16 values come back from the forward's pre (or the recompute's product) and the
    backward gives the bits of a bf16 backward on that pre, not a read of the E4M3 bytes as bf16."""
    import cupy

    N, C = 128, 64
    F = 4 * C
    dev = _mlp_operands(np.random.default_rng(), N, C)

    def backward(pre, act, outside):
        grads = {k: cupy.full(sh, np.nan, dtype=dt) for k, sh, dt in (
            ("dinp", (N, C), np.float32), ("dW_1", (C, F), np.float32), ("dW_2", (F, C), np.float32),
            ("dpre", (N, F), "bfloat16"))}
        engine.mlp_bwd(grads["dinp"], grads["dW_1"], grads["dW_2"], grads["dpre"], dev["dout"], dev["inp"], pre, act,
                       dev["W_1"], dev["W_2"], recompute=recompute, overwrite=True, overwrite_weights=True,
                       act_history=outside)
        return {k: cupy.asnumpy(v) for k, v in grads.items()}

    out, pre, act = (cupy.full(sh, np.nan, dtype="bfloat16") for sh in ((N, C), (N, F), (N, F)))
    drow = cupy.asarray(fp8_history_row([1.0]))
    with engine.fp8_pass():
        engine.mlp_fwd(out, pre, act, dev["inp"], dev["W_1"], dev["W_2"], recompute=recompute, act_history=drow)
        assert engine.fp8_book.bytes_of(act, "e4m3") is not None  # the forward took the E4M3 path
        kept_pre = pre.copy()
        monkeypatch.setattr(engine, "fp8", False)
        got = backward(pre, act, drow)
    # the reference: bf16 from the start of the backward, on the forward's pre (a recompute rebuilds pre itself)
    ref_act = cupy.full((N, F), np.nan, dtype="bfloat16")
    if not recompute:
        engine._gelu(ref_act, kept_pre)
    want = backward(kept_pre, ref_act, None)
    for k in want:
        assert np.isfinite(got[k].astype(np.float32)).all(), k
        np.testing.assert_array_equal(got[k].view(np.uint8), want[k].view(np.uint8), err_msg=k)


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True])
def test_a_dw2_with_no_fp8_algorithm_reads_the_e4m3_act_in_bf16(engine, monkeypatch, recompute):
    """On the act history's path, with no FP8 algorithm for dW_2 (the other products on FP8): act's bf16 values come
    back from pre (GELU(pre), as the plain path writes act), and dW_2 is the plain product on them, bit for bit."""
    import cupy

    N, C = 128, 64
    F = 4 * C
    dev = _mlp_operands(np.random.default_rng(), N, C)
    out, pre, act, dpre = (cupy.full(sh, np.nan, dtype="bfloat16") for sh in ((N, C), (N, F), (N, F), (N, F)))
    dinp, dW_1, dW_2 = (cupy.full(sh, np.nan, dtype=np.float32) for sh in ((N, C), (C, F), (F, C)))
    drow = cupy.asarray(fp8_history_row([1.0]))
    with engine.fp8_pass():
        engine.mlp_fwd(out, pre, act, dev["inp"], dev["W_1"], dev["W_2"], recompute=recompute, act_history=drow)
        assert engine.fp8_book.bytes_of(act, "e4m3") is not None  # the forward took the E4M3 path
        _no_fp8_algorithm_for(engine, monkeypatch, dW_2)
        engine.mlp_bwd(dinp, dW_1, dW_2, dpre, dev["dout"], dev["inp"], pre, act, dev["W_1"], dev["W_2"],
                       recompute=recompute, overwrite=True, overwrite_weights=True, act_history=drow)
    monkeypatch.undo()
    ref_act = cupy.full((N, F), np.nan, dtype="bfloat16")
    engine._gelu(ref_act, pre)  # pre: the forward's, or the recompute's with the forward's bits
    want = cupy.full((F, C), np.nan, dtype=np.float32)
    engine.blas.gemm(want, ref_act, dev["dout"], F, C, N, trans_a=True, beta=0.0)
    for name, x in (("dinp", dinp), ("dW_1", dW_1), ("dW_2", dW_2)):
        assert np.isfinite(cupy.asnumpy(x)).all(), name
    np.testing.assert_array_equal(cupy.asnumpy(dW_2).view(np.uint8), cupy.asnumpy(want).view(np.uint8))


@pytest.mark.gpu
def test_a_dw2_with_no_fp8_algorithm_after_dpre_wrote_over_act_raises(engine, monkeypatch):
    """A recomputing layer's dpre is act's own buffer (model.py). Where dpre's FP8 product ran and dW_2's found no
    algorithm, act is already overwritten: mlp_bwd says so instead of reading dpre's values as act."""
    import cupy

    N, C = 128, 64
    F = 4 * C
    dev = _mlp_operands(np.random.default_rng(), N, C)
    out, pre, act = (cupy.full(sh, np.nan, dtype="bfloat16") for sh in ((N, C), (N, F), (N, F)))
    dinp, dW_1, dW_2 = (cupy.full(sh, np.nan, dtype=np.float32) for sh in ((N, C), (C, F), (F, C)))
    drow = cupy.asarray(fp8_history_row([1.0]))
    with engine.fp8_pass():
        engine.mlp_fwd(out, pre, act, dev["inp"], dev["W_1"], dev["W_2"], recompute=True, act_history=drow)
        _no_fp8_algorithm_for(engine, monkeypatch, dW_2)
        with pytest.raises(RuntimeError, match="shares act's buffer"):
            engine.mlp_bwd(dinp, dW_1, dW_2, act, dev["dout"], dev["inp"], pre, act, dev["W_1"], dev["W_2"],
                           recompute=True, overwrite=True, keep_dpre=False, overwrite_weights=True, act_history=drow)


def _give_pass_slots(engine, monkeypatch) -> None:
    """The pass's amax slots, as a one-layer model's plan gives them, where no model built on this engine gave them
    yet (the LayerNorm's E4M3 path takes one; without, it writes bf16)."""
    import cupy

    if engine.own.get("fp8_amax") is None:
        spec = next(b for b in fp8.plan_buffers(1, 1, 64, 1, 64) if b.name == "fp8_amax")
        monkeypatch.setitem(engine.own, "fp8_amax", cupy.zeros(spec.shape, dtype=spec.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True])
def test_an_mlp_forward_with_fp8_turned_off_reads_a_layernorm_s_e4m3_output_in_bf16(engine, monkeypatch, recompute):
    """A LayerNorm that wrote its output as E4M3 bytes only, then the MLP's forward with FP8 products off inside the
    same pass (its GELU products on bf16, with pre or, recomputed, act alone): the LayerNorm runs again first and
    the MLP gives the bits of a forward on the LayerNorm's bf16 output."""
    import cupy

    _give_pass_slots(engine, monkeypatch)
    rng = np.random.default_rng()
    N, C = 128, 64
    F = 4 * C
    dev = {k: cupy.asarray(_bf16(rng.standard_normal(shape) * scale).astype("bfloat16")) for k, shape, scale in (
        ("x", (N, C), 1.0), ("gamma", (C,), 1.0), ("beta", (C,), 0.1), ("W_1", (C, F), C**-0.5),
        ("W_2", (F, C), F**-0.5))}

    def forward(e4m3):
        ln = cupy.full((N, C), np.nan, dtype="bfloat16")
        mean, rstd = (cupy.full((N,), np.nan, dtype=np.float32) for _ in range(2))
        out, pre, act = (cupy.full(sh, np.nan, dtype="bfloat16") for sh in ((N, C), (N, F), (N, F)))
        engine.layernorm_fwd(ln, mean, rstd, dev["x"], dev["gamma"], dev["beta"], e4m3=e4m3)
        if e4m3:
            assert engine.fp8_book.bytes_of(ln, "e4m3") is not None  # the LayerNorm took the E4M3 path
            monkeypatch.setattr(engine, "fp8", False)
        engine.mlp_fwd(out, pre, act, ln, dev["W_1"], dev["W_2"], recompute=recompute)
        monkeypatch.setattr(engine, "fp8", True)
        return {k: cupy.asnumpy(v) for k, v in (("ln", ln), ("out", out), ("act", act))}

    with engine.fp8_pass():
        got = forward(True)
    monkeypatch.setattr(engine, "fp8", False)
    want = forward(False)
    for k in want:
        assert np.isfinite(got[k].astype(np.float32)).all(), k
        np.testing.assert_array_equal(got[k].view(np.uint16), want[k].view(np.uint16), err_msg=k)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H", [(2, 128, 2), (1, 208, 3)])
def test_the_attention_backward_writes_dqkv_in_e5m2_at_the_history_s_scale(engine, B, T, H):
    """In a training pass with a dqkv history row attn_bwd writes the model's rows of dqkv as E5M2 bytes only: X
    [N, 3C] the bytes of the plain backward's bf16 dqkv cast at the row's scale (quantize; values past it saturate),
    X^T [3C, N] beside them; the pass is folded into the row as the reference folds dqkv's amax; attn_qkv_bwd's
    products take those bytes at this pass's descale (against float64 products of them), and a read of dqkv as
    bf16 (Fp8Book.readable) runs the backward again: the plain bits."""
    import cupy

    rng = np.random.default_rng()
    C = 64 * H
    N = B * T
    qkv = cupy.asarray(_bf16(rng.standard_normal((3, B, T, C))).astype("bfloat16"))
    dout = cupy.asarray(_bf16(rng.standard_normal((B, T, C)) * 1e-2).astype("bfloat16"))
    inp = _bf16(rng.standard_normal((N, C)))
    W = _bf16(rng.standard_normal((3, C, C)) * C**-0.5)
    out, lse = cupy.full((B, T, C), np.nan, dtype="bfloat16"), cupy.full((B, H, T), np.nan, dtype=np.float32)
    engine.attn_fwd(out, lse, qkv, H)

    def backward(row=None):
        rows = cupy.full((B, T, 3, C), np.nan, dtype="bfloat16")
        view, delta = rows.transpose(2, 0, 1, 3), cupy.full((B, H, T), np.nan, dtype=np.float32)
        engine.attn_bwd(view, delta, dout, qkv, out, lse, H, overwrite=True, dqkv_history=row)
        return rows, view

    plain = cupy.asnumpy(backward()[0]).astype(np.float32).reshape(N, 3 * C)
    amax = float(np.abs(plain).max())
    start = fp8_history_row([0.45 * amax], "dqkv")  # a scale that saturates dqkv's largest values (the act test's)
    s = float(start[fp8.history_field("SCALE")])
    drow = cupy.asarray(start)
    dinp, dW = cupy.full((N, C), np.nan, dtype=np.float32), cupy.full((3, C, C), np.nan, dtype=np.float32)
    with engine.fp8_pass():
        rows, view = backward(drow)
        assert engine.fp8_book.bytes_of(view, "e5m2") is not None
        got = cupy.asnumpy(rows).reshape(-1).view(np.uint8).copy()
        engine.attn_qkv_bwd(dinp, dW, view, cupy.asarray(inp.reshape(B, T, C).astype("bfloat16")),
                            cupy.asarray(W.astype("bfloat16")), overwrite=True, overwrite_weights=True,
                            dqkv_history=drow)
        engine.fp8_book.readable(view)
        reread = cupy.asnumpy(rows).astype(np.float32).reshape(N, 3 * C)
    q, qt = got[:N * 3 * C].reshape(N, 3 * C), got[N * 3 * C:].reshape(3 * C, N)
    want_q, _ = fp8.quantize(plain, "e5m2", fp8.FORMATS["e5m2"][1] / s)
    np.testing.assert_array_equal(q, want_q.reshape(N, 3 * C))
    np.testing.assert_array_equal(qt, q.T)
    assert (np.abs(plain) * s > fp8.FORMATS["e5m2"][1]).any()  # some saturated
    want = start.copy()
    fp8.fold_amax(want, amax, "e5m2")
    np.testing.assert_array_equal(cupy.asnumpy(drow), want)
    np.testing.assert_array_equal(reread.view(np.uint32), plain.view(np.uint32))
    dq = fp8.dequantize(q, 1.0 / s, "e5m2")
    x, w = (fp8.dequantize(*fp8.quantize(a, "e4m3"), "e4m3") for a in (inp, W))
    ref = {"dW": np.stack([x.T @ dq[:, i * C:(i + 1) * C] for i in range(3)]),
           "dinp": sum(dq[:, i * C:(i + 1) * C] @ w[i].T for i in range(3))}
    for k, a in (("dW", dW), ("dinp", dinp)):
        rel = np.linalg.norm(cupy.asnumpy(a) - ref[k]) / np.linalg.norm(ref[k])
        assert rel <= 1e-2, (k, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("N, C, fused", [(256, 64, True), (208, 48, False), (4096, 768, True), (1008, 384, False)])
def test_the_layernorm_writes_its_output_as_e4m3_at_the_bound_s_scale(engine, monkeypatch, N, C, fused):
    """Inside a pass a LayerNorm given `e4m3` writes X and X^T as the bytes of its bf16 output cast at e4m3_bound's
    scale (quantize), the residual sum, mean and rstd as without the flag; the products take those bytes
    (Fp8Book.cast_saving, saved_transpose), and a read as bf16 (readable) gets the plain LayerNorm's bits.
    A forward alone leaves X^T's half of the bytes unwritten; outside a pass the flag changes nothing."""
    import cupy

    from andrea.ops.layernorm import e4m3_bound

    _give_pass_slots(engine, monkeypatch)
    rng = np.random.default_rng()
    gamma = (1 + 0.3 * rng.standard_normal(C)).astype(np.float32)
    beta = (0.2 * rng.standard_normal(C)).astype(np.float32)
    host = {"a": _bf16(rng.standard_normal((N, C)) * 2 + 0.5), "b": _bf16(rng.standard_normal((N, C)))}
    dev = {k: cupy.asarray(v.astype("bfloat16")) for k, v in host.items()}
    dev["gamma"], dev["beta"] = cupy.asarray(gamma), cupy.asarray(beta)
    bound = e4m3_bound(gamma, beta)

    def run(e4m3, in_pass=True, backward=True):
        res = dev["a"].copy() if not fused else cupy.full((N, C), np.nan, dtype="bfloat16")
        out = cupy.full((N, C), np.nan, dtype="bfloat16")
        mean, rstd = cupy.full(N, np.nan, dtype=np.float32), cupy.full(N, np.nan, dtype=np.float32)
        got = {}
        with engine.fp8_pass(backward) if in_pass else contextlib.nullcontext():
            if fused:
                engine.residual_layernorm_fwd(res, out, mean, rstd, dev["a"], dev["b"], dev["gamma"], dev["beta"],
                                              e4m3=e4m3)
            else:
                engine.layernorm_fwd(out, mean, rstd, res, dev["gamma"], dev["beta"], e4m3=e4m3)
            got["bytes"] = cupy.asnumpy(out).reshape(-1).view(np.uint8).copy()
            if e4m3 and in_pass:
                q, descale = engine.fp8_book.cast_saving(out, N, C, None, False)
                got["q"], got["descale"] = cupy.asnumpy(q).reshape(N, C), float(cupy.asnumpy(descale)[0])
                saved = engine.fp8_book.saved_transpose(out)
                got["qt"] = None if saved is None else cupy.asnumpy(saved[0]).reshape(C, N)
                engine.fp8_book.readable(out)
                assert engine.fp8_book.saved_transpose(out) is None  # the bytes are gone with the rerun
        got.update(res=cupy.asnumpy(res), mean=cupy.asnumpy(mean), rstd=cupy.asnumpy(rstd), out=cupy.asnumpy(out))
        return got

    plain, written, alone, outside = run(False), run(True), run(True, backward=False), run(True, in_pass=False)
    want, descale = fp8.quantize(plain["out"].astype(np.float32), "e4m3", amax=bound)
    np.testing.assert_array_equal(written["q"], want)
    np.testing.assert_array_equal(written["qt"], want.T)
    assert written["descale"] == descale == 2.0 ** -fp8.scale_exponent(bound, "e4m3")
    np.testing.assert_array_equal(written["bytes"], np.concatenate([want.reshape(-1), want.T.reshape(-1)]))
    np.testing.assert_array_equal(alone["q"], want)
    assert alone["qt"] is None
    assert np.isnan(alone["bytes"][N * C:].view("bfloat16").astype(np.float32)).all()  # X^T's half untouched
    for got in (written, alone, outside):
        for k in ("res", "mean", "rstd", "out"):
            np.testing.assert_array_equal(got[k].view(np.uint8), plain[k].view(np.uint8), err_msg=k)
    assert np.abs(plain["out"].astype(np.float32)).max() <= bound * (1 + 2.0**-7)
