"""The NCCL id file under srun: keyed by the job (and each requeue of it), removed once it has served,
never taken from an earlier job in the same run folder."""

import json
import threading

import pytest

from andrea.run import parallel
from andrea.common.errors import AndreaError
from andrea.run.parallel import Rank, forget_unique_id, unique_id
from andrea.store.runfiles import RunFiles


@pytest.fixture
def srun_job(monkeypatch):
    monkeypatch.delenv(parallel.NCCL_ID_ENV, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeued job: same job id as the last one
    ids = iter(["aa" * 8, "bb" * 8])
    monkeypatch.setattr(parallel, "new_unique_id", lambda: next(ids))
    monkeypatch.setattr(parallel, "ID_WAIT_S", 1.0)


def test_a_rank_never_reads_the_last_jobs_id(tmp_path, srun_job):
    files = RunFiles(tmp_path / "run.ckpt")
    # what the previous attempt of this job (restart count 0) and an old-style run left behind
    files.nccl_id("4242.0.0").write_text(json.dumps({"job": "4242.0.0", "nccl_id": "cc" * 8}))
    (tmp_path / "run.ckpt.nccl-id").write_text(json.dumps("dd" * 8))
    with pytest.raises(AndreaError, match=r"rank 0 of job 4242\.0\.1 did not publish"):
        unique_id(Rank(1, 2, 1), files)

    got = {}
    reader = threading.Thread(target=lambda: got.setdefault(1, unique_id(Rank(1, 2, 1), files)))
    reader.start()
    assert unique_id(Rank(0, 2, 0), files) == bytes.fromhex("aa" * 8)
    reader.join(timeout=5)
    assert got[1] == bytes.fromhex("aa" * 8)
    assert files.nccl_ids() == [files.nccl_id("4242.0.1")]  # rank 0 removed the stale ones

    forget_unique_id(Rank(1, 2, 1), files)
    assert files.nccl_ids() == [files.nccl_id("4242.0.1")]  # only rank 0 removes it
    forget_unique_id(Rank(0, 2, 0), files)
    assert files.nccl_ids() == []


def test_the_launcher_hands_the_id_over_without_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv(parallel.NCCL_ID_ENV, "ee" * 8)
    files = RunFiles(tmp_path / "run.ckpt")
    assert unique_id(Rank(1, 2, 1), files) == bytes.fromhex("ee" * 8)
    forget_unique_id(Rank(0, 2, 0), files)
    assert files.nccl_ids() == []
