"""The CUDA engine at the experiments' own shapes (marker `gpu`; tests/test_cuda_engine.py covers small
and odd shapes): every op against float64 NumPy, training against the NumPy engine, bf16 against fp32
over 200 steps, determinism, the memory plan against what the device hands out, SIGTERM + --resume
through `andrea train`, and a checkpoint moving between the engines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from andrea.spec.config import load_experiment
from andrea.schedule.crosscheck import (OP_LIMITS, OPS, compare_op, free_device_memory, step_allocations,
                                        text_training, train_run)
from andrea.spec.layout import ParameterLayout
from andrea.ops.base import OpShape
from andrea.spec.precision import PRECISIONS
from andrea.store.shards import write_shard
from andrea.run.train import model_options
from conftest import EXPERIMENTS, REPO

pytestmark = pytest.mark.gpu

EXPERIMENT = {name: load_experiment(EXPERIMENTS / f"ANDREA-{name}-TRAIN.json") for name in ("tiny", "12M", "120M")}
# Micro-batch of the op comparison: the float64 reference of the 120M classifier ([1024, 768] x [768, 50304] and
# its two backward products) must stay seconds on the host.
OP_BATCH = {"tiny": 4, "12M": 4, "120M": 1}
LIMITS = OP_LIMITS["experiment"]
TRAIN_STEPS = 20
TRAIN_LIMITS = {"fp32": 1e-3, "tf32": 2e-2, "bf16": 3e-2, "fp16": 2e-2, "fp8": 5e-2}  # max |loss - numpy loss| / numpy loss
BENCH_BATCH = {"12M": 32, "120M": 8}  # the benchmark's (and the PyTorch peer's) micro-batch
PARITY_STEPS, PARITY_LIMIT = 200, 0.01
FP8_PARITY_LIMIT = 0.015  # fp8 against bf16 after PARITY_STEPS
# FP8 parity as judged over inits: after PARITY_STEPS of text, (fp8 held-out loss - bf16's) / bf16's averaged over
# FP8_INITS inits within FP8_MEAN_LIMIT, and no init worse than FP8_WORST_LIMIT
FP8_INITS, FP8_MEAN_LIMIT, FP8_WORST_LIMIT = 8, 0.01, 0.03


def options(name: str) -> dict:
    """The memory options (recompute, loss_chunks) the trainer gives the experiment's model on the CUDA engine,
    in every precision."""
    return model_options(EXPERIMENT[name], "cuda")


@pytest.fixture(scope="module")
def engines():
    from andrea.engines.cuda_engine import CudaEngine

    return {p: CudaEngine(precision=p) for p in PRECISIONS}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", list(OP_BATCH))
def test_op_at_the_experiment_shape(engines, name, op):
    seed = int(np.random.SeedSequence().entropy % 2**63)
    result = compare_op(engines, op, OpShape.of(EXPERIMENT[name].model, B=OP_BATCH[name]), np.random.default_rng(seed))
    free_device_memory()
    bad = {p: {k: e for k, e in out.items() if not e["rel"] <= LIMITS[p]} for p, out in result.items()}
    assert not any(bad.values()), f"seed {seed}: {bad}"


@pytest.mark.parametrize("name, micro, n_micro", [("tiny", 4, 2), ("12M", 2, 2)])
def test_training_follows_the_numpy_engine(engines, name, micro, n_micro):
    from andrea.engines.numpy_engine import NumpyEngine

    shape = EXPERIMENT[name].model
    ref = train_run(NumpyEngine(), shape, micro, n_micro, TRAIN_STEPS)
    for precision, engine in engines.items():
        run = train_run(engine, shape, micro, n_micro, TRAIN_STEPS, **options(name))
        free_device_memory()
        worst = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses))
        assert worst <= TRAIN_LIMITS[precision], (precision, worst, run.losses, ref.losses)


def test_bf16_follows_fp32_over_200_steps(engines):
    shape, micro = EXPERIMENT["12M"].model, BENCH_BATCH["12M"]
    runs = {p: train_run(engines[p], shape, micro, 1, PARITY_STEPS, **options("12M")) for p in ("fp32", "bf16")}
    free_device_memory()
    f, b = runs["fp32"].losses, runs["bf16"].losses
    print(f"\n12M B={micro}, {PARITY_STEPS} steps: final loss fp32 {f[-1]:.4f}, bf16 {b[-1]:.4f}, rel "
          f"{abs(b[-1] - f[-1]) / f[-1]:.2e}")
    assert abs(b[-1] - f[-1]) / f[-1] <= PARITY_LIMIT


def test_fp8_follows_bf16_over_200_steps_at_120m(engines):
    """ANDREA-120M in fp8 ends 200 steps of the synthetic stream from the same init within 1.5% of bf16's loss.
    Step 200 lies in the stream's memorising drop, whose timing moves with any rounding, and fp8's bits depend on the
    card's FP8 algorithms, so this passes or fails by where the drop falls on the card at hand (it fails on an H200;
    docs/PERFORMANCE.md, "Known limits"); on real text fp8 follows bf16 closely (the test below)."""
    shape, micro = EXPERIMENT["120M"].model, BENCH_BATCH["120M"]
    runs = {p: train_run(engines[p], shape, micro, 1, PARITY_STEPS, **options("120M")) for p in ("bf16", "fp8")}
    free_device_memory()
    b, f = runs["bf16"].losses, runs["fp8"].losses
    rel = abs(f[-1] - b[-1]) / b[-1]
    print(f"\n120M B={micro}, {PARITY_STEPS} steps: final loss bf16 {b[-1]:.4f}, fp8 {f[-1]:.4f}, rel {rel:.2e}; "
          f"mean of the last 10: bf16 {np.mean(b[-10:]):.4f}, fp8 {np.mean(f[-10:]):.4f}")
    assert rel <= FP8_PARITY_LIMIT


def test_fp8_follows_bf16_on_text_over_200_steps_at_120m(engines, embedded_text):
    """ANDREA-120M in fp8 and in bf16, 200 steps of the embedded corpus from the same init and on the same
    windows: the held-out loss after them (the validation shard) within 1.5%. One init is a draw: the gap moves from
    init to init, and this init passes (docs/PERFORMANCE.md, "Known limits")."""
    shape, micro = EXPERIMENT["120M"].model, BENCH_BATCH["120M"]
    text = text_training(embedded_text, shape.seq_len, micro)
    runs = {p: train_run(engines[p], shape, micro, 1, PARITY_STEPS, **options("120M"), **text) for p in ("bf16", "fp8")}
    free_device_memory()
    b, f = runs["bf16"], runs["fp8"]
    rel = abs(f.held_out - b.held_out) / b.held_out
    print(f"\n120M B={micro}, {PARITY_STEPS} steps of text: held-out loss bf16 {b.held_out:.4f}, fp8 {f.held_out:.4f}, "
          f"rel {rel:.2e}; last training loss bf16 {b.losses[-1]:.4f}, fp8 {f.losses[-1]:.4f}")
    assert rel <= FP8_PARITY_LIMIT


def test_fp8_follows_bf16_on_text_over_inits_at_120m(engines, embedded_text):
    """One init is a draw (the test above), so parity is judged over FP8_INITS of them: ANDREA-120M in fp8 and in bf16
    from each init, 200 steps of the embedded corpus on the same windows; the mean of the held-out losses' relative
    gap within 1.0%, and fp8 no more than 3% worse at any init."""
    shape, micro = EXPERIMENT["120M"].model, BENCH_BATCH["120M"]
    text = text_training(embedded_text, shape.seq_len, micro)
    gaps = []
    for seed in range(FP8_INITS):
        runs = {p: train_run(engines[p], shape, micro, 1, PARITY_STEPS, seed=seed, **options("120M"), **text)
                for p in ("bf16", "fp8")}
        free_device_memory()
        gaps.append((runs["fp8"].held_out - runs["bf16"].held_out) / runs["bf16"].held_out)
    print(f"\n120M B={micro}, {PARITY_STEPS} steps of text, {FP8_INITS} inits: (fp8 - bf16) / bf16 held-out loss "
          + ", ".join(f"{g:+.2%}" for g in gaps) + f"; mean {np.mean(gaps):+.2%}")
    assert abs(np.mean(gaps)) <= FP8_MEAN_LIMIT and max(gaps) <= FP8_WORST_LIMIT, gaps


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name, micro, steps", [("12M", 8, 10), ("120M", 2, 3)])
def test_deterministic_at_the_experiment_shape(engines, precision, name, micro, steps):
    digests = [train_run(engines[precision], EXPERIMENT[name].model, micro, 2, steps, **options(name)).digest
               for _ in range(2)]
    free_device_memory()
    assert digests[0] == digests[1]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("name", list(BENCH_BATCH))
def test_the_plan_is_the_device_memory_and_a_step_allocates_nothing(name, precision):
    """The trainer's printed plan (training model + the sampler inside its memory) against what CuPy's pool hands
    out for both: the sampler allocates nothing."""
    import cupy

    from andrea.engines.cuda_engine import ALIGN, CudaEngine
    from andrea.spec.memory import device_bytes
    from andrea.schedule.model import Model, init_params
    from andrea.tools.sample import Sampler

    free_device_memory()
    pool = cupy.get_default_memory_pool()
    # what the pool hands out (used bytes): blocks it still caches from earlier tests may serve part of it
    before = pool.used_bytes()
    engine = CudaEngine(precision=precision)
    shape = EXPERIMENT[name].model
    model = Model(engine, shape, BENCH_BATCH[name], **options(name))
    tokenizer = SimpleNamespace(vocab_size=shape.vocab_size, im_end_id=1, endoftext_id=0)  # what Sampler reads of one
    with_model = pool.used_bytes()
    sampler = Sampler(engine, shape, tokenizer, share=model).model.plan
    assert pool.used_bytes() == with_model and sampler.inside
    model.load_state(init_params(model.layout, 0))
    step_allocations(model, step=0)
    counts = step_allocations(model, step=1)
    assert counts["pool_requests"] == 0 and counts["used_after"] == counts["used_before"]
    planned = device_bytes(model.plan, sampler)  # what the trainer prints
    grown = pool.used_bytes() - before
    assert planned == model.plan.total_bytes
    padding = ALIGN * len(model.plan.buffers)
    print(f"\n{name} {precision}: plan {planned / 2**20:,.1f} MiB (the sampler's {sampler.total_bytes / 2**20:,.1f} MiB inside it), "
          f"pool {grown / 2**20:,.1f} MiB")
    assert planned <= grown <= planned + padding + 2**20  # CuPy rounds each allocation to 512 bytes
    del model, engine
    free_device_memory()


def tiny_run(tmp_path, steps, intervals, precision="fp32"):
    raw = json.loads((EXPERIMENTS / "ANDREA-tiny-TRAIN.json").read_text())
    raw.update(train={"steps": steps}, intervals=intervals, precision=precision)
    experiment = tmp_path / "tiny.json"
    experiment.write_text(json.dumps(raw))
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    pattern = np.random.default_rng(0).integers(0, 512, 300)
    write_shard(data / "train.bin", np.tile(pattern, 200))
    write_shard(data / "val.bin", np.tile(pattern, 20))
    return experiment, data


ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def train(experiment, data, out, engine, stop, *extra, popen=False):
    cmd = [sys.executable, "-m", "andrea.cli", "train", "--experiment", str(experiment), "--data", str(data),
           "--out", str(out), "--engine", engine, "--max-steps", str(stop), *extra]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_sigterm_then_resume_equals_an_unbroken_run(tmp_path, precision):
    # validation every step slows the run enough for the signal to land mid-run; it leaves the weights alone
    experiment, data = tiny_run(tmp_path, 400, {"checkpoint": 1000, "sample": 0, "eval": 1, "eval_batches": 8}, precision)
    stop = 60
    train(experiment, data, tmp_path / "whole.ckpt", "cuda", stop)
    broken = tmp_path / "broken.ckpt"
    proc = train(experiment, data, broken, "cuda", stop, popen=True)
    loss = tmp_path / "broken.loss.json"
    deadline = time.time() + 120
    while (not loss.is_file() or loss.read_text().count('"loss"') < 5) and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stopped = int(np.frombuffer(broken.read_bytes()[:4], dtype="<i4")[0])
    assert 0 < stopped < stop
    train(experiment, data, broken, "cuda", stop, "--resume")
    assert broken.read_bytes() == (tmp_path / "whole.ckpt").read_bytes()


def test_a_checkpoint_moves_between_the_engines(tmp_path):
    """5 steps on one engine, resumed to 10 on the other: each step's loss and the final weights follow
    10 steps on the NumPy engine alone (fp32)."""
    steps = 10
    experiment, data = tiny_run(tmp_path, steps, {"checkpoint": 1000, "sample": 0, "eval": 0, "eval_batches": 2})
    n = ParameterLayout(EXPERIMENT["tiny"].model).n_params

    def run(name, engines):
        ckpt = tmp_path / f"{name}.ckpt"
        for i, (engine, stop) in enumerate(zip(engines, [steps // 2, steps] if len(engines) == 2 else [steps])):
            train(experiment, data, ckpt, engine, stop, *(["--resume"] if i else []))
        from andrea.store.runfiles import read_loss_history

        losses = [r["loss"] for r in read_loss_history(ckpt.with_suffix(".loss.json"))]
        return losses, np.frombuffer(ckpt.read_bytes()[8:8 + 4 * n], dtype="<f4").astype(np.float64)

    ref_losses, ref_w = run("numpy", ("numpy",))
    for first, second in (("cuda", "numpy"), ("numpy", "cuda")):
        losses, w = run(f"{first}_then_{second}", (first, second))
        assert len(losses) == steps
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-4
        assert np.linalg.norm(w - ref_w) / np.linalg.norm(ref_w) <= 1e-4
