"""Cross-checks of an engine against the NumPy reference: every op pair on fresh random inputs,
training steps from one init, determinism, and steps that allocate nothing.

Used by tests/test_cuda_engine.py (small shapes) and scripts/gpu_check.py (the experiments' shapes).
Inputs are never zeros: gradient buffers start random (backward ops add into them), and every
buffer an op overwrites starts as NaN, so an element it fails to write shows up as an error.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from andrea.config import ModelShape
from andrea.engines.numpy_engine import NumpyEngine
from andrea.layout import ParameterLayout
from andrea.memory import GRAD_NORM_PARTIALS
from andrea.model import Model, init_params

OPS = ("embed", "layernorm", "residual_layernorm", "layernorm_residual", "attn_qkv", "attn", "attn_out", "mlp", "mlp_recompute",
       "residual_add", "loss", "loss_in_place", "grad_norm", "adamw",
       # the input gradient written, not added (it starts as NaN: an element the op fails to write shows)
       "attn_qkv/overwrite", "attn/overwrite", "attn_out/overwrite", "mlp/overwrite", "loss_in_place/overwrite")
OPTIMIZER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}
WARMUP_STEPS = 5


@dataclass(frozen=True)
class OpShape:
    B: int
    T: int
    C: int
    H: int
    V: int
    n_params: int
    decay_ranges: tuple

    @classmethod
    def of(cls, shape: ModelShape, B: int, T: int | None = None) -> "OpShape":
        layout = ParameterLayout(shape)
        return cls(B, T or shape.seq_len, shape.d_model, shape.n_head, shape.vocab_size, layout.n_params,
                   tuple(layout.decay_ranges()))


@dataclass
class OpCase:
    arrays: dict  # host inputs and starting outputs: float64, or int32 for token ids
    run: Callable  # run(engine, arrays) -> dict of scalars: the forward, then the backward
    checked: tuple  # arrays compared after run
    # Arrays in the engine's activation dtype (act_dtype: bf16 under mixed precision); the rest are float.
    act: tuple = ()
    # For an engine whose attention saves the logsumexp (attention = "lse"): its own starting arrays,
    # and the references that replace the NumPy engine's for it, computed from the inputs.
    lse_arrays: dict = field(default_factory=dict)
    lse_reference: Callable | None = None


def _randn(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def _nan(*shape):
    return np.full(shape, np.nan)


def _tokens(rng, B, T, V):
    """Random ids, half of them from 8 values: many repeats for the embedding backward."""
    ids = rng.integers(0, V, (B, T))
    few = rng.integers(0, V, 8)
    pick = rng.random((B, T)) < 0.5
    ids[pick] = few[rng.integers(0, 8, int(pick.sum()))]
    return ids.astype(np.int32)


def make_case(op: str, s: OpShape, rng) -> OpCase:
    """`op`, or `op/overwrite`: its backward writes the input's gradient (which starts as NaN) instead of adding."""
    B, T, C, H, V = s.B, s.T, s.C, s.H, s.V
    F = 4 * C
    w = C**-0.5
    op, _, mode = op.partition("/")
    ow = mode == "overwrite"

    def grad_in(*shape):  # an input gradient: added into (random start) or overwritten (NaN start)
        return _nan(*shape) if ow else _randn(rng, *shape)
    if op == "embed":
        a = {"tokens": _tokens(rng, B, T, V), "wte": _randn(rng, V, C), "wpe": _randn(rng, T, C),
             "out": _nan(B, T, C), "dwte": _randn(rng, V, C), "dwpe": _randn(rng, T, C), "dout": _randn(rng, B, T, C)}

        def run(E, x):
            E.embed_fwd(x["out"], x["tokens"], x["wte"], x["wpe"])
            E.embed_bwd(x["dwte"], x["dwpe"], x["dout"], x["tokens"])

        return OpCase(a, run, ("out", "dwte", "dwpe"), act=("out",))
    if op == "layernorm":
        a = {"inp": _randn(rng, B, T, C) * 3 + 1, "gamma": _randn(rng, C), "beta": _randn(rng, C),
             "out": _nan(B, T, C), "mean": _nan(B, T), "rstd": _nan(B, T),
             "dinp": _randn(rng, B, T, C), "dgamma": _randn(rng, C), "dbeta": _randn(rng, C), "dout": _randn(rng, B, T, C)}

        def run(E, x):
            E.layernorm_fwd(x["out"], x["mean"], x["rstd"], x["inp"], x["gamma"], x["beta"])
            E.layernorm_bwd(x["dinp"], x["dgamma"], x["dbeta"], x["dout"], x["inp"], x["gamma"], x["mean"], x["rstd"])

        return OpCase(a, run, ("out", "mean", "rstd", "dinp", "dgamma", "dbeta"), act=("inp", "out"))
    if op == "residual_layernorm":  # residual_add and the layernorm_fwd after it, as one call
        a = {"a": _randn(rng, B, T, C) * 3 + 1, "b": _randn(rng, B, T, C), "gamma": _randn(rng, C),
             "beta": _randn(rng, C), "res": _nan(B, T, C), "out": _nan(B, T, C), "mean": _nan(B, T), "rstd": _nan(B, T)}

        def run(E, x):
            E.residual_layernorm_fwd(x["res"], x["out"], x["mean"], x["rstd"], x["a"], x["b"], x["gamma"], x["beta"])

        return OpCase(a, run, ("res", "out", "mean", "rstd"), act=("a", "b", "res", "out"))
    if op == "layernorm_residual":  # layernorm_bwd and the residual connection's backward, as one call
        a = {"inp": _randn(rng, B, T, C) * 3 + 1, "gamma": _randn(rng, C), "beta": _randn(rng, C),
             "out": _nan(B, T, C), "mean": _nan(B, T), "rstd": _nan(B, T), "dinp": _randn(rng, B, T, C),
             "dbranch": _nan(B, T, C), "dgamma": _randn(rng, C), "dbeta": _randn(rng, C), "dout": _randn(rng, B, T, C)}

        def run(E, x):
            E.layernorm_fwd(x["out"], x["mean"], x["rstd"], x["inp"], x["gamma"], x["beta"])
            E.layernorm_residual_bwd(x["dinp"], x["dbranch"], x["dgamma"], x["dbeta"], x["dout"], x["inp"], x["gamma"],
                                     x["mean"], x["rstd"])

        return OpCase(a, run, ("dinp", "dbranch", "dgamma", "dbeta"), act=("inp", "out", "dbranch"))
    if op == "attn_qkv":
        a = {"inp": _randn(rng, B, T, C), "W_Q": _randn(rng, C, C, scale=w), "W_K": _randn(rng, C, C, scale=w),
             "W_V": _randn(rng, C, C, scale=w), "qkv": _nan(3, B, T, C), "dinp": grad_in(B, T, C),
             "dW_Q": _randn(rng, C, C), "dW_K": _randn(rng, C, C), "dW_V": _randn(rng, C, C), "dqkv": _randn(rng, 3, B, T, C)}

        def run(E, x):
            E.attn_qkv_fwd(x["qkv"], x["inp"], x["W_Q"], x["W_K"], x["W_V"])
            E.attn_qkv_bwd(x["dinp"], x["dW_Q"], x["dW_K"], x["dW_V"], x["dqkv"], x["inp"], x["W_Q"], x["W_K"], x["W_V"],
                           overwrite=ow)

        return OpCase(a, run, ("qkv", "dinp", "dW_Q", "dW_K", "dW_V"), act=("inp", "W_Q", "W_K", "W_V", "qkv", "dqkv"))
    if op == "attn":
        a = {"qkv": _randn(rng, 3, B, T, C), "out": _nan(B, T, C), "att": _nan(B, H, T, T),
             "dqkv": grad_in(3, B, T, C), "datt": _nan(B, H, T, T), "dout": _randn(rng, B, T, C)}

        def run(E, x):
            E.attn_fwd(x["out"], x["att"], x["qkv"], H)
            E.attn_bwd(x["dqkv"], x["datt"], x["dout"], x["qkv"], x["out"], x["att"], H, overwrite=ow)

        # datt is scratch: its contents are the engine's
        return OpCase(a, run, ("out", "att", "dqkv"), lse_arrays={"att": _nan(B, H, T), "datt": _nan(B, H, T)},
                      lse_reference=lambda x: {"att": attention_lse(x["qkv"], H)}, act=("qkv", "out", "dqkv", "dout"))
    if op == "attn_out":
        a = {"inp": _randn(rng, B, T, C), "W_O": _randn(rng, C, C, scale=w), "out": _nan(B, T, C),
             "dinp": grad_in(B, T, C), "dW_O": _randn(rng, C, C), "dout": _randn(rng, B, T, C)}

        def run(E, x):
            E.attn_out_fwd(x["out"], x["inp"], x["W_O"])
            E.attn_out_bwd(x["dinp"], x["dW_O"], x["dout"], x["inp"], x["W_O"], overwrite=ow)

        return OpCase(a, run, ("out", "dinp", "dW_O"), act=("inp", "W_O", "out", "dinp", "dout"))
    if op in ("mlp", "mlp_recompute"):
        recompute = op == "mlp_recompute"
        a = {"inp": _randn(rng, B, T, C), "W_1": _randn(rng, C, F, scale=w), "W_2": _randn(rng, F, C, scale=F**-0.5),
             "out": _nan(B, T, C), "pre": _nan(B, T, F), "act": _nan(B, T, F), "dinp": grad_in(B, T, C),
             "dW_1": _randn(rng, C, F), "dW_2": _randn(rng, F, C), "dpre": _nan(B, T, F), "dout": _randn(rng, B, T, C)}

        def run(E, x):
            E.mlp_fwd(x["out"], x["pre"], x["act"], x["inp"], x["W_1"], x["W_2"])
            if recompute:  # the backward must rebuild act from pre
                E.upload(x["act"], np.full(x["act"].shape, np.nan, dtype=np.float32))
            E.mlp_bwd(x["dinp"], x["dW_1"], x["dW_2"], x["dpre"], x["dout"], x["inp"], x["pre"], x["act"], x["W_1"],
                      x["W_2"], recompute=recompute, overwrite=ow)

        return OpCase(a, run, ("out", "pre", "act", "dinp", "dW_1", "dW_2", "dpre"),
                      act=("inp", "W_1", "W_2", "out", "pre", "act", "dpre", "dout"))
    if op == "residual_add":
        a = {"a": _randn(rng, B, T, C), "b": _randn(rng, B, T, C), "out": _nan(B, T, C),
             "da": _randn(rng, B, T, C), "db": _randn(rng, B, T, C), "dout": _randn(rng, B, T, C)}

        def run(E, x):
            E.residual_add(x["out"], x["a"], x["b"])
            E.residual_add_bwd(x["da"], x["db"], x["dout"])

        return OpCase(a, run, ("out", "da", "db"), act=("a", "b", "out", "db"))
    if op in ("loss", "loss_in_place"):
        in_place = op == "loss_in_place"  # d_logits is probs itself, as the model runs it
        a = {"inp": _randn(rng, B, T, C), "wte": _randn(rng, V, C, scale=2 * w),
             "targets": rng.integers(0, V, (B, T)).astype(np.int32), "losses": _nan(B, T), "probs": _nan(B, T, V),
             "dinp": grad_in(B, T, C), "dwte": _randn(rng, V, C), "dlogits": _nan(B, T, V)}

        def run(E, x):
            E.loss_fwd(x["losses"], x["probs"], x["inp"], x["wte"], x["targets"])
            mean = E.mean_loss(x["losses"])
            dlogits = x["probs"] if in_place else x["dlogits"]
            E.loss_bwd(x["dinp"], x["dwte"], dlogits, x["probs"], x["inp"], x["wte"], x["targets"], 1.0 / (B * T),
                       overwrite=ow)
            return {"mean_loss": mean}

        checked = ("losses", "probs", "dinp", "dwte") + (() if in_place else ("dlogits",))
        return OpCase(a, run, checked, act=("inp", "wte", "probs", "dlogits"))
    if op == "grad_norm":
        a = {"grads": _randn(rng, s.n_params, scale=1e-3), "partials": _nan(GRAD_NORM_PARTIALS), "norm": _nan(1)}

        def run(E, x):
            E.grad_norm_partial(x["partials"], x["grads"])
            E.grad_norm_final(x["norm"], x["partials"])
            E.grad_scale(x["grads"], 0.37)

        return OpCase(a, run, ("partials", "norm", "grads"))
    if op == "adamw":
        n = s.n_params
        a = {"params": _randn(rng, n, scale=0.02), "grads": _randn(rng, n, scale=1e-3),
             "m": _randn(rng, n, scale=1e-4), "v": np.abs(_randn(rng, n, scale=1e-6)), "params_lp": _nan(n)}

        def run(E, x):
            E.adamw_step(x["params"], x["grads"], x["m"], x["v"], lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                         weight_decay=0.1, step=7, decay_ranges=list(s.decay_ranges), params_lp=x["params_lp"])

        return OpCase(a, run, ("params", "m", "v", "params_lp"), act=("params_lp",))
    raise ValueError(f"unknown op {op!r}; one of {OPS}")


def attention_lse(qkv, n_head: int) -> np.ndarray:
    """Per-row logsumexp of the causal scaled scores, [B, H, T], in float64: what a fused attention saves."""
    _, B, T, C = qkv.shape
    hd = C // n_head
    q, k = (np.asarray(qkv[i], dtype=np.float64).reshape(B, T, n_head, hd).transpose(0, 2, 1, 3) for i in (0, 1))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    s[..., np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
    top = s.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(s - top).sum(axis=-1, keepdims=True)))[..., 0]


def errors(got, want) -> dict:
    """max |got - want| and ||got - want|| / ||want||; an unwritten (NaN) element makes both inf."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return {"max_abs": float("inf"), "rel": float("inf")}
    diff = got - want
    return {"max_abs": float(np.max(np.abs(diff))), "rel": float(np.linalg.norm(diff) / max(np.linalg.norm(want), 1e-30))}


def compare_op(engines: dict, op: str, s: OpShape, rng, reference=None) -> dict:
    """Run `op` (forward then backward) on each engine and on the float64 NumPy reference from the
    same fresh random inputs (rounded to float32 first, and the activations of a bf16 engine to bf16,
    so only the engines' arithmetic differs); returns {engine name: {output name: errors}}."""
    reference = reference or NumpyEngine("float64")
    case = make_case(op, s, rng)
    refs = {}  # act dtype -> (inputs, reference outputs, reference scalars)
    results = {}
    for name, engine in engines.items():
        act_dtype = getattr(engine, "act_dtype", "float32")
        if act_dtype not in refs:
            def start_value(k, v):
                if v.dtype.kind == "i":
                    return v
                v = v.astype(np.float32)
                if k in case.act:  # a value the engine's activation dtype holds exactly (ml_dtypes rounds bf16 to nearest even)
                    v = v.astype(act_dtype).astype(np.float32)
                return v.astype(np.float64)

            inputs = {k: start_value(k, v) for k, v in case.arrays.items()}
            ref = {k: v.copy() for k, v in inputs.items()}
            refs[act_dtype] = inputs, ref, case.run(reference, ref) or {}
        inputs, ref, ref_scalars = refs[act_dtype]
        start, want = inputs, ref
        if case.lse_arrays and getattr(engine, "attention", "probs") == "lse":
            start, want = {**inputs, **case.lse_arrays}, {**ref, **case.lse_reference(inputs)}
        # converted on the host: bf16 through NumPy's ml_dtypes, exact (the values are bf16 already)
        dev = {k: engine.xp.asarray(v if v.dtype.kind == "i" else v.astype(act_dtype if k in case.act else engine.dtype))
               for k, v in start.items()}
        scalars = case.run(engine, dev) or {}
        engine.synchronize()
        out = {k: errors(engine.to_host(dev[k]), want[k]) for k in case.checked}
        out.update({k: errors(scalars[k], ref_scalars[k]) for k in ref_scalars})
        results[name] = out
    return results


# ---- training --------------------------------------------------------------------------------
def synthetic_micro_batches(shape: ModelShape, micro_batch: int, n_micro: int, step: int, seed: int = 0):
    """A learnable stream: windows of one fixed random sequence at random offsets, 10% of the
    tokens replaced by noise. The batch is a pure function of (seed, step)."""
    T, V = shape.seq_len, shape.vocab_size
    pattern = np.random.default_rng(seed).integers(0, V, 997)
    rng = np.random.default_rng([seed, step])
    rows = []
    for _ in range(micro_batch * n_micro):
        row = pattern[(rng.integers(0, pattern.size) + np.arange(T + 1)) % pattern.size]
        noise = rng.random(T + 1) < 0.1
        row[noise] = rng.integers(0, V, int(noise.sum()))
        rows.append(row)
    rows = np.asarray(rows, dtype=np.int32)
    x, y = rows[:, :-1], rows[:, 1:]
    return list(zip(np.split(x, n_micro), np.split(y, n_micro)))


def lr_at(step: int) -> float:
    return OPTIMIZER["lr"] * min(1.0, (step + 1) / WARMUP_STEPS)


@dataclass
class TrainRun:
    losses: list
    norms: list
    digest: str  # sha256 of the final params, m and v bytes
    params: np.ndarray


def train_run(engine, shape: ModelShape, micro_batch: int, n_micro: int, steps: int, seed: int = 1337,
              recompute: tuple[str, ...] = (), loss_chunks: int = 1) -> TrainRun:
    """`steps` optimizer steps from init_params(seed) on synthetic batches."""
    model = Model(engine, shape, micro_batch, recompute=recompute, loss_chunks=loss_chunks)
    model.load_state(init_params(model.layout, seed))
    losses, norms = [], []
    for step in range(steps):
        loss, norm = model.train_step(synthetic_micro_batches(shape, micro_batch, n_micro, step, seed),
                                      step=step, lr=lr_at(step), optimizer=OPTIMIZER)
        losses.append(loss)
        norms.append(norm)
    params, m, v = model.host_state()
    digest = hashlib.sha256(params.tobytes() + m.tobytes() + v.tobytes()).hexdigest()
    return TrainRun(losses, norms, digest, params)


def step_allocations(model, step: int = 0, seed: int = 0) -> dict:
    """One train_step on a CuPy engine, counting requests to CuPy's memory pool and its used bytes."""
    import cupy

    class Counter(cupy.cuda.MemoryHook):
        name = "andrea_step_allocations"

        def __init__(self):
            self.requests = 0

        def malloc_preprocess(self, **kwargs):
            self.requests += 1

    batches = synthetic_micro_batches(model.shape, model.micro_batch, 1, step, seed)
    pool = cupy.get_default_memory_pool()
    model.engine.synchronize()
    before = pool.used_bytes()
    with Counter() as counter:
        model.train_step(batches, step=step, lr=lr_at(step), optimizer=OPTIMIZER)
        model.engine.synchronize()
    return {"pool_requests": counter.requests, "used_before": before, "used_after": pool.used_bytes()}
