"""The run's book: NAME.state.json and the files it vouches for, kept by `andrea train`.

    NAME.state.json          what the checkpoint format cannot hold: experiment, step, data, tokenizer, phases,
                             mixing state, and the sha256 of the recent checkpoints (`checkpoints`) and the best
    NAME.ckpt                the last checkpoint; the state vouches for it and the one before
    NAME.best.ckpt           the checkpoint at the best validation loss so far (`best`)
    NAME.archive/<phase>/    each finished phase's checkpoint, samples and state
    NAME.loss.json events    start, resume, checkpoint, best, pivot, nonfinite, ... (andrea.store.runfiles reads them)

Every write goes in the order that makes a kill at any instant safe (docs/RELIABILITY.md): the state before the
checkpoint it vouches for, the state's `best` before NAME.best.ckpt, an archive beside its place before it is
renamed into it.

Checkpoints are written behind the loop: the model's state is copied to the host and checked on the loop's thread,
and a thread of the book's own hashes and writes it (with the state that vouches for it) while training goes on,
one write at a time, in the order asked. Their events and log lines come on the loop's thread once a write is done
(`settle`); a failed write stops the run there, at the latest before the process ends.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone

from andrea import __version__
from andrea.common.atomic import write_json_atomic
from andrea.store.checkpoint import checkpoint_digest, read_state, untrusted_values, write_checkpoint
from andrea.common.errors import AndreaError
from andrea.store.runfiles import RESTARTS_ENV, RunFiles, append_record

STATE_FORMAT = 1
# How many recent checkpoints .state.json vouches for: a kill between renaming the checkpoint and
# renaming the state leaves a checkpoint that is one of these two.
STATE_CHECKPOINT_HISTORY = 2
# Checkpoint writes in flight at most (a step's best checkpoint and its interval one); one more waits for the oldest,
# so host copies of the model's state never pile up behind a slow disk.
WRITES_IN_FLIGHT = 2


def take_lock(files: RunFiles):
    """One trainer per run: a second one on the same --out would interleave its writes. The open lock file is
    returned: the lock lasts as long as it stays open. Temp files of a killed write are removed under it."""
    lock = open(files.lock, "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise AndreaError(f"{files.ckpt}: another `andrea train` is writing this run; wait for it or stop it") from None
    for stale in files.stale_temp_files():
        stale.unlink(missing_ok=True)
    return lock


class UntrustedState(Exception):
    """The model's state holds numbers that cannot be trusted (a NaN weight, m or v; a negative v): nothing of it
    is written, the run stops."""

    def __init__(self, step: int, detail: str):
        super().__init__(detail)
        self.step = step


class RunBook:
    """The state, checkpoints, best checkpoint, phase archives and events of one run; on a rank other than the
    main one, nothing here touches a file (the ranks of a data-parallel run share --out). The trainer sets `model` once it is built, and
    `stop` / `stopped_by` once it knows where this invocation stops; the loop draws from and updates `mix_state`."""

    def __init__(self, files: RunFiles, exp, overrides: list[str], program, data: dict, train_tokens: int,
                 tokenizer: dict | None, mixture, mix_state, best_metric: str, log, is_main: bool):
        self.files, self.exp, self.overrides, self.program, self.mixture = files, exp, overrides, program, mixture
        self.data, self.train_tokens, self.tokenizer = data, train_tokens, tokenizer
        self.best_metric = best_metric  # the validation loss a best checkpoint is chosen by
        self.log, self.is_main = log, is_main
        self.mix_state = mix_state  # the mixing state: the loop draws from it; each checkpoint holds it
        self.model = None
        self.stop: int | None = None
        self.stopped_by: str | None = None
        self.data_history: list[dict] = []  # the data of earlier stretches of a run resumed with --switch-data
        self.recent_checkpoints: list[dict] = []
        self.skipped_steps: list[int] = []
        self.best: dict | None = None  # {"step", "metric", "value", "sha256"} of NAME.best.ckpt
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="andrea-checkpoint") if is_main else None
        # the writes behind the loop, oldest first: (future, what to announce once done, the entry of a checkpoint,
        # the params array of the host copy it reads)
        self._in_flight: list[tuple[Future, Callable[[], None], dict | None, object]] = []
        # (step, params, m, v, {"sha256"}) last copied: a step's best and interval checkpoints share it
        self._host: tuple | None = None
        # the (params, m, v) host arrays copies are made into, filled again; at most WRITES_IN_FLIGHT sets
        self._host_sets: list[tuple] = []
        self._write_failed = False  # set on the writer thread; nothing is written after it

    # ---- NAME.loss.json ------------------------------------------------------------------------
    def event(self, name: str, **fields) -> None:
        if self.is_main:
            self.append({"event": name, "wall": time.time(), **fields})

    def append(self, record: dict) -> None:
        try:
            append_record(self.files.loss, record)
        except OSError as err:
            self._drain()  # the writes in flight done, not announced: their events would append to this file
            last = self.last_checkpoint()
            survivor = f"the checkpoint of step {last} ({self.files.ckpt}) is intact" if last is not None \
                else "no checkpoint was written yet"
            raise AndreaError(
                f"{self.files.loss}: could not append to the loss history ({err.strerror or err}); {survivor}; "
                "free space or fix the disk, then rerun with --resume (a cut-short line is ended and skipped)"
            ) from None

    # ---- starting ------------------------------------------------------------------------------
    def set_aside(self, resume: bool) -> None:
        """Before a start from step 0 or --init-from: what an earlier run on this --out left without a checkpoint
        is moved aside (NAME.*.old), never written over."""
        if not self.is_main:
            return
        files = self.files
        if resume:
            # Resume before the first checkpoint: start over, keeping the history (later lines win).
            self.log(f"resume: no checkpoint at {files.ckpt} yet; starting from step 0")
        else:
            # Outputs of a run that left no checkpoint: keep them aside, start clean.
            for path in (files.loss, files.samples):
                if path.exists():
                    old = path.with_name(path.name + ".old")
                    path.replace(old)
                    self.log(f"moved {path.name} of a run that left no checkpoint to {old}")
        if files.best.exists() and not files.state.exists():
            # a best checkpoint no state vouches for: its run never completed a checkpoint; kept aside
            old = files.best.with_name(files.best.name + ".old")
            files.best.replace(old)
            self.log(f"moved {files.best.name}, which no state vouches for, to {old}")

    def resume(self, state: dict, step: int, data_history: list[dict]) -> dict:
        """The book as the state resumed from left it at `step`; the checkpoint entry of that step ({} if the state
        holds none): its elapsed time and mixing state."""
        best = state.get("best")
        self.best = best if best and best["step"] <= step else None
        self.recent_checkpoints = [c for c in state.get("checkpoints", []) if c["step"] <= step]
        self.skipped_steps = [s for s in state.get("skipped_steps", []) if s <= step]
        self.data_history = data_history
        matched = [c for c in self.recent_checkpoints if c["step"] == step]
        return matched[-1] if matched else {}

    # ---- checkpoints ---------------------------------------------------------------------------
    def last_checkpoint(self) -> int | None:
        return self.recent_checkpoints[-1]["step"] if self.recent_checkpoints else None

    def trusted_host_state(self, step: int, what: str):
        """(params, m, v) on the host and a dict the writer fills with their digest ("sha256"), refused when they hold
        a NaN or a negative v: such an update went through a finite loss and gradient norm (from state that was
        already bad), and is never written. A second call at the same step (its best and its interval checkpoint)
        reuses the first one's copies."""
        if self._host is not None and self._host[0] == step:
            return self._host[1:]
        into = self._free_host_set()
        self._host = None  # `into` may be the arrays it named
        params, m, v = self.model.host_state(out=into)
        if into is None:
            self._host_sets.append((params, m, v))
        fault = untrusted_values(params, m, v)
        if fault:
            raise UntrustedState(step, f"step {step}: {fault} in the model's state; "
                                       f"the {what} was not written")
        self._host = (step, params, m, v, {})
        return self._host[1:]

    def _free_host_set(self) -> tuple | None:
        """Host arrays for the next copy of the state that no write in flight reads; None (new ones, kept) while
        fewer than WRITES_IN_FLIGHT sets exist, else after the oldest write is done. Arrays filled again have their
        pages mapped already: new ones fault in every page of the state during the copy, with the loop waiting."""
        while True:
            held = {id(holds) for *_, holds in self._in_flight}
            free = [s for s in self._host_sets if id(s[0]) not in held]
            if free:
                return free[0]
            if len(self._host_sets) < WRITES_IN_FLIGHT:
                return None
            self._settle_oldest()

    @staticmethod
    def _digest(step: int, params, m, v, digest: dict) -> str:
        """On the writer thread: the checkpoint's sha256, once for both writes of a step."""
        if "sha256" not in digest:
            digest["sha256"] = checkpoint_digest(step, params, m, v)
        return digest["sha256"]

    def _behind(self, write, announce, entry: dict | None, holds) -> None:
        """`write` (files only) on the writer thread after the writes asked before it; `announce` (events, log
        lines) on this thread once it is done (settle); `holds`: the host copy's params array, which it reads. After
        a failed write the ones asked later write nothing: their states vouch for the checkpoint that failed."""
        while len(self._in_flight) >= WRITES_IN_FLIGHT:
            self._settle_oldest()

        def guarded():
            if self._write_failed:
                raise AndreaError("not written: an earlier checkpoint write failed")
            try:
                write()
            except BaseException:
                self._write_failed = True
                raise
        self._in_flight.append((self._writer.submit(guarded), announce, entry, holds))

    def _settle_oldest(self) -> None:
        future, announce, entry, _ = self._in_flight.pop(0)
        try:
            future.result()
        except BaseException:
            if entry is not None:  # never written: the state on disk vouches for the one before it
                self.recent_checkpoints = [c for c in self.recent_checkpoints if c is not entry]
            raise
        announce()

    def settle(self, wait: bool = True) -> None:
        """Announce the writes that are done, in order; with `wait`, every write in flight is done first. A failed
        write raises its AndreaError here (the ones after it are still finished, so no file is left half done)."""
        while self._in_flight and (wait or self._in_flight[0][0].done()):
            try:
                self._settle_oldest()
            except BaseException:
                self._drain()
                raise
        if not self._in_flight:
            self._host = None  # no write holds the host copies any more

    def _drain(self) -> None:
        """Wait for the writes in flight without announcing them: after a failure (they write nothing) or at the end
        of a run that failed; their checkpoints are not counted as written."""
        for future, _, entry, _ in self._in_flight:
            if future.exception() is not None and entry is not None:
                self.recent_checkpoints = [c for c in self.recent_checkpoints if c is not entry]
        self._in_flight.clear()

    def last_written_checkpoint(self) -> int | None:
        """The step of the last checkpoint on disk, once the writes in flight are done; for the sentences that name
        it. A write that failed meanwhile is logged, not raised: the sentence is about another fault."""
        try:
            self.settle()
        except AndreaError as err:
            self.log(str(err))
        return self.last_checkpoint()

    def close(self) -> None:
        """At the end of the run, however it ends: no write left going on (a failure is the caller's to report)."""
        self._drain()
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    def checkpoint(self, step: int, elapsed: float, reason: str) -> None:
        """Checkpoint + state, written behind the loop so that a kill at any instant leaves a pair that resumes:
        the state is written first and vouches for both the new and the previous checkpoint."""
        if not self.is_main:
            return
        params, m, v, digest = self.trusted_host_state(step, "checkpoint")
        # the mixing state goes with each checkpoint: the state file may vouch for the one before this one too
        entry = {"step": step, "sha256": None, "elapsed_s": elapsed, "mixing": self.mix_state.to_json(),
                 "tokens_per_source": self.tokens_per_source()}
        self.recent_checkpoints = [c for c in self.recent_checkpoints if c["step"] != step][-(STATE_CHECKPOINT_HISTORY - 1):] + [entry]
        # the state as it is now; the digests of this and earlier writes are filled in on the writer thread, in order
        state = self.state(step, elapsed)
        previous = f"the previous checkpoint (step {self.recent_checkpoints[-2]['step']}) is intact" \
            if len(self.recent_checkpoints) > 1 else "no earlier checkpoint exists"

        def write():
            entry["sha256"] = self._digest(step, params, m, v, digest)
            try:
                write_json_atomic(self.files.state, state)
                write_checkpoint(self.files.ckpt, step, params, m, v)
            except OSError as err:
                raise AndreaError(
                    f"{err.filename or self.files.ckpt}: could not write the step-{step} checkpoint "
                    f"({err.strerror or err}); {previous}; free space or fix the disk, then rerun with --resume"
                ) from None

        def announce():
            self.event("checkpoint", step=step, reason=reason)
            self.log(f"checkpoint: step {step} -> {self.files.ckpt} ({reason})")
        self._behind(write, announce, entry, params)

    def offer_best(self, step: int, record: dict) -> None:
        """NAME.best.ckpt, when the step's record holds the best validation loss so far."""
        if self.best_metric in record and (self.best is None or record[self.best_metric] < self.best["value"]):
            self.write_best(step, record[self.best_metric])

    def write_best(self, step: int, value: float) -> None:
        """NAME.best.ckpt (the seed's format) at the best headline validation loss so far, written behind the loop.
        The state on disk is told first (its `best`, the one before kept as `best_previous`), so a kill at any
        instant leaves a best checkpoint the state vouches for."""
        params, m, v, digest = self.trusted_host_state(step, "best checkpoint")
        previous, self.best = self.best, {"step": step, "metric": self.best_metric, "value": value, "sha256": None}
        best = self.best

        def write():
            best["sha256"] = self._digest(step, params, m, v, digest)
            if self.files.state.is_file():
                state = read_state(self.files.ckpt)
                write_json_atomic(self.files.state, {**state, "best": best, "best_previous": previous})
            write_checkpoint(self.files.best, step, params, m, v)

        def announce():
            self.event("best", step=step, val_loss=value, metric=self.best_metric)
        self._behind(write, announce, None, params)

    # ---- phases --------------------------------------------------------------------------------
    def pivot(self, phase, step: int, elapsed: float) -> None:
        """The end of a phase followed by another: its checkpoint, as SIGUSR1 writes one, then its archive."""
        self.checkpoint(step, elapsed, "pivot")
        self.settle()  # the archive copies what the checkpoint wrote
        self.archive(phase)
        self.pivot_event(phase, step)

    def pivot_event(self, phase, step: int) -> None:
        nxt = self.program.phase_at(step)
        self.event("pivot", step=step, **{"from": phase.name, "to": nxt.name})
        self.log(f"pivot: phase {phase.name} done at step {step}; archived in {self.files.phase_archive(phase.name)}; "
                 f"phase {nxt.name} starts")

    def archive(self, phase) -> None:
        """NAME.archive/<phase>/: the checkpoint, samples and state at the phase's end (the loss history runs
        on, never archived). Written beside, then renamed into place: a kill leaves no half archive."""
        if not self.is_main:
            return
        final = self.files.phase_archive(phase.name)
        tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for path in (self.files.ckpt, self.files.samples, self.files.state):
            if path.is_file():
                shutil.copy2(path, tmp / path.name)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    def catch_up_archive(self, step: int) -> None:
        """A run stopped at a pivot before its archive was written (a kill, or --max-steps there) archives it now:
        its checkpoint is the phase's end."""
        for phase in self.program.phases:
            archived = self.files.phase_archive(phase.name).is_dir()
            if phase.end == step < self.program.total_steps and not archived and self.files.ckpt.is_file():
                self.archive(phase)
                self.pivot_event(phase, step)

    # ---- NAME.state.json -----------------------------------------------------------------------
    def write_state(self, step: int, elapsed: float) -> None:
        if self.is_main:
            self.settle()  # after the states written behind the loop
            write_json_atomic(self.files.state, self.state(step, elapsed))

    def state(self, step: int, elapsed: float) -> dict:
        exp, program, model = self.exp, self.program, self.model
        return {
            "format": STATE_FORMAT,
            "andrea_version": __version__,
            "experiment_path": exp.path,
            "experiment": exp.raw,  # the effective experiment: the file with the overrides applied
            "overrides": list(self.overrides),  # the --set items, as given
            "trajectory_hash": exp.trajectory_hash(),
            "step": step,
            "total_steps": program.total_steps,
            # why a checkpoint before the program's end is the last of this invocation (None: the run goes on)
            "unfinished": None if step >= program.total_steps or step < self.stop else self.stopped_by,
            "samples_seen": step * exp.batch_size,
            "tokens_seen": step * exp.tokens_per_step,
            "data": self.data,
            # the train split's tokens: the program's lengths in epochs (config.continuation_refusal) count from it
            "train_tokens": self.train_tokens,
            "tokenizer": self.tokenizer,
            **({"data_history": list(self.data_history)} if self.data_history else {}),
            "batch_scheme": "window permutation per epoch from PCG64(seed, epoch); see andrea/store/loader.py",
            "phases": [{"name": p.name, "start": p.start, "end": p.end, "hash": p.hash(), "loss_on": p.loss_on,
                        "status": "finished" if p.end <= step else "running" if p.start < step else "waiting"}
                       for p in program.phases],
            "phase": program.phase_at(min(step, program.total_steps - 1)).name,
            "mixing": self.mix_state.to_json(),
            "tokens_per_source": self.tokens_per_source(),
            "best": self.best,
            "best_previous": None,
            "engine": model.engine.name,
            **({"cpu": self.cpu()} if model.engine.name == "numpy" else {}),
            "n_params": model.layout.n_params,
            "checkpoints": list(self.recent_checkpoints),  # the entries themselves: their digests come from the writer
            "skipped_steps": list(self.skipped_steps),
            **({"loss_scale": model.loss_scale.state()} if model.loss_scale else {}),
            **model.history_state(),
            "restarts": int(os.environ.get(RESTARTS_ENV, "0")),
            "elapsed_s": elapsed,
            "written_at": datetime.now(timezone.utc).isoformat(),
        }

    def tokens_per_source(self) -> dict:
        """Train tokens (targets) each source gave to the steps trained so far."""
        names = self.mixture.names
        return {names[k]: rows * self.exp.model.seq_len for k, rows in enumerate(self.mix_state.rows)}

    def cpu(self) -> dict:
        """What a CPU run's bytes depend on: NumPy, its BLAS and how products are cut (not the thread count)."""
        return self.model.engine.products.describe()
