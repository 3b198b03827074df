"""CPU results do not depend on the thread count: products in fixed blocks on one-thread BLAS."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from andrea.engines.cpu_blas import SPLIT_MULTIPLY_ADDS, BlockedProducts, blas_library


@pytest.mark.parametrize("shape", [
    ((700, 96), (96, 130)),            # rows cut
    ((96, 700), (700, 300)),           # columns cut (M < N)
    ((3, 4, 128, 32), (3, 4, 32, 128)),  # batched
    ((4, 128, 96), (96, 200)),         # batch of rows times one matrix
])
def test_blocked_products_same_bytes_on_any_thread_count(shape):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(shape[0], dtype=np.float32)
    b = rng.standard_normal(shape[1], dtype=np.float32)
    assert np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2])) * a.shape[-2] * a.shape[-1] * b.shape[-1] \
        >= SPLIT_MULTIPLY_ADDS  # large enough to be cut into blocks
    results = [BlockedProducts(threads).matmul(a, b) for threads in (1, 2, 3)]
    assert results[0].tobytes() == results[1].tobytes() == results[2].tobytes()
    np.testing.assert_allclose(results[0], a @ b, rtol=1e-4, atol=1e-4)
    out = np.full_like(results[0], np.nan)
    BlockedProducts(2).matmul(a, b, out=out)
    assert out.tobytes() == results[0].tobytes()


def test_transposed_operands():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2048, 64), dtype=np.float32)
    d = rng.standard_normal((2048, 192), dtype=np.float32)
    one, two = BlockedProducts(1).matmul(x.T, d), BlockedProducts(2).matmul(x.T, d)
    assert one.tobytes() == two.tobytes()
    np.testing.assert_allclose(one, x.T @ d, rtol=1e-4, atol=1e-3)


def test_blas_is_described():
    libs = blas_library()
    assert libs and all(lib["internal_api"] for lib in libs)


def train(experiment, data, out, threads, *extra):
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "andrea.cli", "train", "--experiment", str(experiment), "--data", str(data),
           "--out", str(out), "--engine", "numpy", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return out.read_bytes()


def test_one_and_two_threads_and_a_resume_across_them_give_the_same_bytes(tmp_path, tiny_experiment_raw, chat_data):
    raw = dict(tiny_experiment_raw, train={"steps": 12})
    raw["intervals"] = {"checkpoint": 0, "sample": 0, "eval": 6, "eval_batches": 2}
    experiment = tmp_path / "tiny.json"
    experiment.write_text(json.dumps(raw))
    one = train(experiment, chat_data, tmp_path / "one" / "t.ckpt", 1)
    two = train(experiment, chat_data, tmp_path / "two" / "t.ckpt", 2)
    assert one == two
    across = tmp_path / "across" / "t.ckpt"
    train(experiment, chat_data, across, 1, "--max-steps", "5")
    assert train(experiment, chat_data, across, 2, "--resume") == one
    state = json.loads((tmp_path / "two" / "t.state.json").read_text())
    assert state["cpu"]["engine_threads"] == 2 and state["cpu"]["blas"]
