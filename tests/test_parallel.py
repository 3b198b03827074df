"""Data-parallel training through NCCL. Runs where CUDA devices are (marker `gpu`)."""

import json
import subprocess
import sys

import pytest

from andrea.store.runfiles import read_loss_history

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


@pytest.fixture
def bandit_experiment(tmp_path, tiny_experiment_raw):
    raw = dict(tiny_experiment_raw, train={"steps": 16}, mixing={"policy": "bandit"})
    raw["intervals"] = {"checkpoint": 0, "sample": 0, "eval": 8, "eval_batches": 2}
    path = tmp_path / "bandit.json"
    path.write_text(json.dumps(raw))
    return path


def mixing_history(out):
    keep = ("step", "loss", "grad_norm", "mix", "source_loss", "source_sequences", "val_loss_sources")
    return [{k: r[k] for k in keep if k in r} for r in read_loss_history(out.with_name(out.stem + ".loss.json"))]


def test_a_bandit_run_through_nccl_draws_the_mixture_of_one_gpu_and_resumes_exactly(tmp_path, bandit_experiment,
                                                                                      two_sources):
    """Every rank draws the same mixture: the per-source losses are summed over the ranks before the update."""
    single, nccl, part = (tmp_path / d / "run.ckpt" for d in ("single", "nccl", "part"))
    train(bandit_experiment, two_sources, single, "--engine", "cuda")
    train(bandit_experiment, two_sources, nccl, "--gpus", "1")
    assert mixing_history(nccl) == mixing_history(single)
    assert any(r["mix"]["pydocs"] != 0.5 for r in mixing_history(nccl))
    assert nccl.read_bytes() == single.read_bytes()
    train(bandit_experiment, two_sources, part, "--gpus", "1", "--max-steps", "7")
    train(bandit_experiment, two_sources, part, "--gpus", "1", "--resume")
    assert part.read_bytes() == nccl.read_bytes()
    assert mixing_history(part) == mixing_history(nccl)


@pytest.mark.skipif(device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_draw_one_mixture_and_resume_exactly(tmp_path, bandit_experiment, two_sources):
    two, part = tmp_path / "two" / "run.ckpt", tmp_path / "part" / "run.ckpt"
    train(bandit_experiment, two_sources, two, "--gpus", "2")
    train(bandit_experiment, two_sources, part, "--gpus", "2", "--max-steps", "7")
    train(bandit_experiment, two_sources, part, "--gpus", "2", "--resume")
    assert part.read_bytes() == two.read_bytes() and mixing_history(part) == mixing_history(two)
