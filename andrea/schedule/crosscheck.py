"""Cross-checks of an engine against the NumPy reference: every op pair on fresh random inputs (each
op's case lives in its module, andrea/ops/<op>.py), training steps from one init, determinism, and
steps that allocate nothing.

Used by tests/test_cuda_engine.py (small shapes) and tests/test_gpu_scale.py (the experiments' shapes).
Inputs are never zeros: gradient buffers start random (backward ops add into them), and every
buffer an op overwrites starts as NaN, so an element it fails to write shows up as an error.
"""

from __future__ import annotations

import gc
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea import ops
from andrea.spec.config import ModelShape
from andrea.engines.numpy_engine import NumpyEngine
from andrea.schedule.model import Model, init_params
from andrea.ops.base import Draw, OpCase, OpShape

OPS = ops.case_names()
# How far an op's outputs may be from float64 (||got - ref|| / ||ref||), by precision: at the small test
# shapes, and at the experiments' own, whose reductions run up to 50,304 long (the 120M classifier) and
# whose bf16 inputs round more of the sum. fp8: E4M3 keeps 3 mantissa bits (each operand within 1/16) and
# E5M2 2 (within 1/8), so a product on FP8 operands is a few per cent from the exact one, a gradient's more
# (a wrong layout or scale is off by 100% or more); tests/test_fp8_cuda.py checks the FP8 products against float64
# on the same FP8 operands to 1e-2.
OP_LIMITS = {
    "small": {"fp32": 1e-5, "tf32": 5e-3, "bf16": 1.5e-2, "fp16": 1e-2, "fp8": 0.12},
    "experiment": {"fp32": 1e-4, "tf32": 1e-2, "bf16": 2e-2, "fp16": 1e-2, "fp8": 0.12},
}
OPTIMIZER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}
WARMUP_STEPS = 5


def make_case(op: str, s: OpShape, rng) -> OpCase:
    """`op`'s case from its module (andrea/ops/<op>.py), or `op/overwrite`: its backward writes the input's
    gradient (which starts as NaN) instead of adding."""
    name, _, mode = op.partition("/")
    module = ops.case_module(name)
    if mode and name not in module.OVERWRITE_CASES:
        raise ValueError(f"unknown op {op!r}; one of {OPS}")
    return module.case(name, s, Draw(rng, overwrite=mode == "overwrite"))


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
        act_dtype = engine.traits.act_dtype
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
        if case.lse_arrays and engine.traits.attention == "lse":
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
    return _micro_batches(np.asarray(rows, dtype=np.int32), n_micro)


def text_micro_batches(tokens: np.ndarray, T: int, micro_batch: int, n_micro: int, step: int, seed: int = 0):
    """Windows of a token shard (real text) at random offsets, a pure function of (seed, step)."""
    if tokens.size < T + 2:
        raise ValueError(f"a shard of {tokens.size} tokens holds no window of {T + 1}")
    starts = np.random.default_rng([seed, step]).integers(0, tokens.size - T - 1, micro_batch * n_micro)
    return _micro_batches(np.stack([np.asarray(tokens[s:s + T + 1], dtype=np.int32) for s in starts]), n_micro)


def _micro_batches(rows: np.ndarray, n_micro: int) -> list:
    """Rows of T + 1 tokens as n_micro (tokens, targets) pairs, the targets one position on."""
    x, y = rows[:, :-1], rows[:, 1:]
    return list(zip(np.split(x, n_micro), np.split(y, n_micro)))


HELD_OUT_BATCHES = 8  # micro-batches of a validation shard a held-out loss averages


def held_out_micro_batches(tokens: np.ndarray, T: int, micro_batch: int, n: int = HELD_OUT_BATCHES, seed: int = 7):
    """n fixed micro-batches of a validation shard: the held-out loss of train_run."""
    return [b for i in range(n) for b in text_micro_batches(tokens, T, micro_batch, 1, i, seed)]


def text_training(folder, T: int, micro_batch: int) -> dict:
    """train_run's `stream` and `held_out` for the text of a tokens folder (train.bin, val.bin): one micro-batch a
    step of train.bin's windows, and val.bin's held-out micro-batches (the text parity test's runs)."""
    from andrea.store.shards import read_shard

    train = read_shard(Path(folder) / "train.bin")
    return {"stream": lambda step: text_micro_batches(train, T, micro_batch, 1, step),
            "held_out": held_out_micro_batches(read_shard(Path(folder) / "val.bin"), T, micro_batch)}


def lr_at(step: int) -> float:
    return OPTIMIZER["lr"] * min(1.0, (step + 1) / WARMUP_STEPS)


@dataclass
class TrainRun:
    losses: list
    norms: list
    digest: str  # sha256 of the final params, m and v bytes
    params: np.ndarray
    held_out: float | None = None  # mean loss over the held-out micro-batches after the last step


def train_run(engine, shape: ModelShape, micro_batch: int, n_micro: int, steps: int, seed: int = 1337,
              recompute: tuple[str, ...] = (), loss_chunks: int = 1, stream=None, held_out=(),
              recompute_layers: int | None = None, poison_grads: bool = False) -> TrainRun:
    """`steps` optimizer steps from init_params(seed) on the batches stream(step) (default: the synthetic
    stream), then the mean loss over the `held_out` micro-batches ((tokens, targets) pairs), if any.
    `poison_grads`: NaN into the gradient buffer before every step, which a step's first micro-batch must write
    whole (no bit of the run may change)."""
    model = Model(engine, shape, micro_batch, recompute=recompute, recompute_layers=recompute_layers,
                  loss_chunks=loss_chunks)
    model.load_state(init_params(model.layout, seed))
    stream = stream or (lambda step: synthetic_micro_batches(shape, micro_batch, n_micro, step, seed))
    losses, norms = [], []
    for step in range(steps):
        if poison_grads:
            model.engine.upload(model.buf["grads"], np.full(model.buf["grads"].shape, np.nan, dtype=np.float32))
        loss, norm = model.train_step(stream(step), step=step, lr=lr_at(step), optimizer=OPTIMIZER)
        losses.append(loss)
        norms.append(norm)
    params, m, v = model.host_state()
    digest = hashlib.sha256(params.tobytes() + m.tobytes() + v.tobytes()).hexdigest()
    held = float(np.mean([model.forward(x, y) for x, y in held_out])) if held_out else None
    return TrainRun(losses, norms, digest, params, held)


MASK_KEPT = 0.7  # loss_masks' share of targets of weight 1


def loss_masks(batches: list, seed: int) -> list:
    """A loss mask for each micro-batch of `batches`: targets kept (weight 1) with probability MASK_KEPT, else 0; a
    fixed draw of `seed`."""
    rng = np.random.default_rng(seed)
    return [(rng.random(y.shape) < MASK_KEPT).astype(np.float32) for _, y in batches]


def free_device_memory() -> None:
    """Give the device memory of dropped models back to the driver. A model's buffers sit in reference cycles (engine,
    ops, recorded graphs), so the collector runs first: otherwise it frees them whenever it next runs, in the middle
    of a later measurement."""
    import cupy

    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()


def step_allocations(model, step: int = 0, seed: int = 0, weighted: bool = False) -> dict:
    """One train_step on a CuPy engine, counting requests to CuPy's memory pool and its used bytes; `weighted`:
    under loss_masks(..., seed)."""
    import cupy

    class Counter(cupy.cuda.MemoryHook):
        name = "andrea_step_allocations"

        def __init__(self):
            self.requests = 0

        def malloc_preprocess(self, **kwargs):
            self.requests += 1

    batches = synthetic_micro_batches(model.shape, model.micro_batch, 1, step, seed)
    weights = loss_masks(batches, seed) if weighted else None
    pool = cupy.get_default_memory_pool()
    model.engine.synchronize()
    before = pool.used_bytes()
    with Counter() as counter:
        model.train_step(batches, step=step, lr=lr_at(step), optimizer=OPTIMIZER, weights=weights)
        model.engine.synchronize()
    return {"pool_requests": counter.requests, "used_before": before, "used_after": pool.used_bytes()}
