"""Data parallelism with NCCL: one process per GPU, gradients all-reduced over the flat buffer.

Ranks: `andrea train --gpus N` starts N processes on one host (rank r uses GPU r); under SLURM,
`srun` starts one task per GPU and the ranks come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID.
The experiment's batch_size is the global batch: rank r takes rows [r·B/N, (r+1)·B/N) of each
step's batch (a pure function of seed, step and r), so a run on N GPUs follows the trajectory of
one GPU up to float summation order, and resume stays bit-exact for a given N.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea.common.atomic import write_json_atomic
from andrea.common.errors import AndreaError
from andrea.store.runfiles import RunFiles
from andrea.run.stop_signals import SIGNALS, STOP_SIGNALS, blocked

RANK_ENV, WORLD_ENV, LOCAL_ENV, NCCL_ID_ENV = "ANDREA_RANK", "ANDREA_WORLD_SIZE", "ANDREA_LOCAL_RANK", "ANDREA_NCCL_ID"
ID_WAIT_S = 300


@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    local: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_from_env() -> Rank | None:
    """This process's rank when started by the launcher or by srun; None for a plain run."""
    if RANK_ENV in os.environ:
        return Rank(int(os.environ[RANK_ENV]), int(os.environ[WORLD_ENV]), int(os.environ[LOCAL_ENV]))
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return Rank(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]),
                    int(os.environ.get("SLURM_LOCALID", "0")))
    return None


def new_unique_id() -> str:
    """A fresh NCCL id as hex (CuPy hands it out as bytes; older releases as a tuple of chars)."""
    from cupy.cuda import nccl

    return bytes(b & 0xFF for b in nccl.get_unique_id()).hex()


def job_key() -> str:
    """What tells one srun job (and each requeue of it) from the last one in the same run folder."""
    parts = [os.environ.get(v) for v in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT")]
    return ".".join(p or "0" for p in parts)


def unique_id(rank: Rank, files: RunFiles) -> bytes:
    """The NCCL id all ranks share: from the launcher's environment, or, under srun, published by rank 0
    in NAME.ckpt.nccl-id.JOB, keyed by the job so that a requeued job never reads the last one's id."""
    if NCCL_ID_ENV in os.environ:
        return bytes.fromhex(os.environ[NCCL_ID_ENV])
    job = job_key()
    id_file = files.nccl_id(job)
    if rank.is_main:
        for stale in files.nccl_ids():
            stale.unlink(missing_ok=True)
        uid = new_unique_id()
        write_json_atomic(id_file, {"job": job, "nccl_id": uid})
        return bytes.fromhex(uid)
    deadline = time.time() + ID_WAIT_S
    while True:
        published = _read_id(id_file)
        if published is not None and published.get("job") == job:
            return bytes.fromhex(published["nccl_id"])
        if time.time() > deadline:
            raise AndreaError(f"{id_file}: rank 0 of job {job} did not publish the NCCL id within {ID_WAIT_S} s")
        time.sleep(0.1)


def _read_id(id_file: Path) -> dict | None:
    try:
        published = json.loads(id_file.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return published if isinstance(published, dict) else None


def forget_unique_id(rank: Rank, files: RunFiles) -> None:
    """Once the communicator is up every rank has read the id: rank 0 removes the file."""
    if rank.is_main and NCCL_ID_ENV not in os.environ:
        files.nccl_id(job_key()).unlink(missing_ok=True)


class DataParallel:
    """The collectives of a data-parallel step. The gradient's sums run on a stream of their own, a bucket
    (a layer's range of the flat buffer) as soon as the backward has finished it, beside the rest of the
    backward (Model._backward); the loss and signal flags on the engine's current stream."""

    def __init__(self, rank: Rank, uid: bytes):
        import cupy
        from cupy.cuda import nccl

        self.rank = rank
        self.world = rank.world
        self._nccl = nccl
        self._cupy = cupy
        self.comm = nccl.NcclCommunicator(rank.world, uid, rank.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)  # the gradient all-reduces
        self._ready, self._done = cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)
        # Small buffers for the loss and the signal flags, allocated once here.
        self._loss = cupy.zeros(1, dtype=np.float64)
        self._flags = cupy.zeros(2, dtype=np.int32)
        self._vector = None  # sum_vector's buffer

    def _all_reduce(self, buf, dtype, op, stream=None) -> None:
        stream = stream or self._cupy.cuda.get_current_stream()
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, dtype, op, stream.ptr)

    def reduce_async(self, grads) -> None:
        """Start summing `grads` (a range of the flat gradient) over the ranks, in place, once everything
        queued so far on the current stream is done; the current stream goes on until wait()."""
        self._ready.record(self._cupy.cuda.get_current_stream())
        self.stream.wait_event(self._ready)
        self._all_reduce(grads, self._nccl.NCCL_FLOAT32, self._nccl.NCCL_SUM, self.stream)

    def wait(self) -> None:
        """The current stream waits for every sum started so far."""
        self._done.record(self.stream)
        self._cupy.cuda.get_current_stream().wait_event(self._done)

    def reduce_loss(self, local_loss: float) -> float:
        """The mean of the ranks' losses."""
        self._loss[0] = local_loss
        self._all_reduce(self._loss, self._nccl.NCCL_FLOAT64, self._nccl.NCCL_SUM)
        return float(self._loss.get()[0]) / self.world

    def sum_vector(self, values: np.ndarray) -> np.ndarray:
        """float64 values summed over the ranks (the same array on every rank): the per-source losses of a
        step. Its device buffer is allocated at the first call and kept (the number of sources is fixed)."""
        if self._vector is None or self._vector.size != values.size:
            self._vector = self._cupy.zeros(values.size, dtype=np.float64)
        self._vector.set(np.ascontiguousarray(values, dtype=np.float64))
        self._all_reduce(self._vector, self._nccl.NCCL_FLOAT64, self._nccl.NCCL_SUM)
        return self._vector.get()

    def agree(self, terminate: bool, snapshot: bool) -> tuple[bool, bool]:
        """A signal seen by any rank is acted on by all, at the same step."""
        nccl = self._nccl
        self._flags[0], self._flags[1] = int(terminate), int(snapshot)
        self._all_reduce(self._flags, nccl.NCCL_INT32, nccl.NCCL_MAX)
        flags = self._flags.get()
        return bool(flags[0]), bool(flags[1])


def launch(command: list[str], n_gpus: int, sigterm_exit_code: int) -> int:
    """Start one process per GPU of this host running `command` (the `andrea train` command of a rank,
    from andrea.run.train.child_command); forward SIGTERM/SIGUSR1 to all, held pending while they start."""
    from cupy.cuda import runtime

    available = runtime.getDeviceCount()
    if n_gpus > available:
        raise AndreaError(f"--gpus {n_gpus}: this host has {available} CUDA device(s)")
    uid = new_unique_id()
    children: list[subprocess.Popen] = []
    pending: list[int] = []
    started = False

    def forward(signum, frame):
        pending.append(signum)
        if started:
            for child in children:
                if child.poll() is None:
                    child.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in SIGNALS}
    try:
        # The ranks start with both signals blocked (each unblocks them once its handlers are in place): one
        # forwarded while they start waits for them instead of killing a rank.
        with blocked():
            if STOP_SIGNALS.terminate or signal.SIGTERM in pending:
                return sigterm_exit_code  # arrived while this process started: nothing to train
            for r in range(n_gpus):
                env = {**os.environ, RANK_ENV: str(r), WORLD_ENV: str(n_gpus), LOCAL_ENV: str(r), NCCL_ID_ENV: uid}
                children.append(subprocess.Popen(command, env=env))
            started = True  # from here forward() reaches every rank; what arrived before goes to all now
            for signum in ([signal.SIGUSR1] if STOP_SIGNALS.snapshot else []) + list(pending):
                for child in children:
                    child.send_signal(signum)
        statuses = [child.wait() for child in children]
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    failed = [s for s in statuses if s != 0]
    return failed[0] if failed else 0
