"""Data-parallel training through NCCL. Runs where CUDA devices are (marker `gpu`)."""

import json
import subprocess
import sys

import pytest

from andrea.runfiles import read_loss_history

pytestmark = pytest.mark.gpu


def device_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@pytest.fixture
def experiment(tmp_path, tiny_experiment_raw):
    raw = dict(tiny_experiment_raw, train={"steps": 20})
    raw["batch"] = {"batch_size": 8, "micro_batches": 2}
    raw["intervals"] = {"checkpoint": 0, "sample": 0, "eval": 10, "eval_batches": 2}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    return path


def train(experiment, data, out, *extra):
    cmd = [sys.executable, "-m", "andrea.cli", "train", "--experiment", str(experiment), "--data", str(data),
           "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_loss_history(out.with_name(out.stem + ".loss.json"))]


def test_world_size_one_through_nccl_equals_single_gpu(tmp_path, experiment, repetitive_data):
    single = train(experiment, repetitive_data, tmp_path / "a" / "run.ckpt", "--engine", "cuda")
    nccl = train(experiment, repetitive_data, tmp_path / "b" / "run.ckpt", "--gpus", "1")
    assert nccl == single
    assert (tmp_path / "a" / "run.ckpt").read_bytes() == (tmp_path / "b" / "run.ckpt").read_bytes()


@pytest.mark.skipif(device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_follow_one_gpu_and_resume_exactly(tmp_path, experiment, repetitive_data):
    one = train(experiment, repetitive_data, tmp_path / "one" / "run.ckpt", "--engine", "cuda")
    two = train(experiment, repetitive_data, tmp_path / "two" / "run.ckpt", "--gpus", "2")
    for (s1, l1, _), (s2, l2, _) in zip(one, two):
        assert s1 == s2 and l2 == pytest.approx(l1, rel=1e-5)
    again = train(experiment, repetitive_data, tmp_path / "again" / "run.ckpt", "--gpus", "2")
    assert again == two
    part = tmp_path / "part" / "run.ckpt"
    train(experiment, repetitive_data, part, "--gpus", "2", "--max-steps", "9")
    train(experiment, repetitive_data, part, "--gpus", "2", "--resume")
    assert part.read_bytes() == (tmp_path / "two" / "run.ckpt").read_bytes()
