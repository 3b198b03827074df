"""The files of one training run and the loss history's reader and writer.

For results/NAME.ckpt: NAME.state.json, NAME.loss.json (JSON Lines: one object per step or event,
appended across resumes and phases, never truncated or archived), NAME.samples.json, NAME.log,
NAME.lock, NAME.best.ckpt (at the best validation loss), NAME.archive/<phase>/ (each finished phase's
checkpoint, samples and state), and while a data-parallel run under srun starts, NAME.nccl-id.JOB. Imported by the trainer, its supervisor,
the report and the dashboard; imports nothing of the engine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

# Exit status of a run stopped by a non-finite loss or gradient (nothing was updated).
EXIT_NONFINITE = 3
# The supervisor's restart count, handed to the trainer it starts.
RESTARTS_ENV = "ANDREA_RESTARTS"
# NAME.best.ckpt: the run's checkpoint at its best validation loss, vouched for by NAME.state.json's `best`
BEST_SUFFIX = ".best.ckpt"


class RunFiles:
    """The files of one training run, named after its checkpoint (results/NAME.ckpt)."""

    def __init__(self, ckpt: Path):
        self.ckpt = Path(ckpt)
        stem = self.ckpt.with_suffix("")
        self.state = stem.with_name(stem.name + ".state.json")
        self.loss = stem.with_name(stem.name + ".loss.json")
        self.samples = stem.with_name(stem.name + ".samples.json")
        self.log = stem.with_name(stem.name + ".log")
        self.lock = stem.with_name(stem.name + ".lock")
        self.best = stem.with_name(stem.name + BEST_SUFFIX)
        self.archive = stem.with_name(stem.name + ".archive")  # NAME.archive/<phase>/: each finished phase

    def phase_archive(self, phase: str) -> Path:
        return self.archive / phase

    def nccl_id(self, job: str) -> Path:
        """Where rank 0 publishes the NCCL id for the ranks of one job (see andrea/run/parallel.py)."""
        return self.ckpt.with_name(f"{self.ckpt.name}.nccl-id.{job}")

    def nccl_ids(self) -> list[Path]:
        return sorted(self.ckpt.parent.glob(f"{self.ckpt.name}.nccl-id*"))

    def stale_temp_files(self) -> list[Path]:
        """Temp files of an atomic write that a killed process left behind."""
        folder = self.ckpt.parent
        return [p for f in (self.ckpt, self.state, self.samples, self.best) for p in folder.glob(f".{f.name}.tmp*")]


def append_record(path: Path, record: dict) -> None:
    """Append one JSON line; a write that fails (disk full) names the file. Strict JSON: a NaN or
    infinity in a record is a bug upstream, not something to write."""
    line = json.dumps(record, allow_nan=False) + "\n"
    try:
        with open(path, "a") as f:
            f.write(line)
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from None


def end_torn_line(path: Path) -> bool:
    """If the history's last line lacks its newline (a write cut short by a full disk or a kill), end
    it, so the next record starts a line of its own; readers then skip the torn one. True if it did."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return False
    if size == 0:
        return False
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return False
        f.write(b"\n")
    return True


# A record is a few hundred bytes (a mixing run's, with its per-source objects, a few kilobytes): a
# longer line is foreign, and is passed over unparsed and never held whole, so that no line of a
# history costs a reader more time or memory than this.
MAX_RECORD_BYTES = 1 << 20
# What json.loads raises for a line that is not JSON; RecursionError for one nested deeper than it goes.
NOT_JSON = (ValueError, UnicodeDecodeError, RecursionError)


def history_lines(f) -> Iterator[bytes]:
    """The lines of the binary file `f`, each with its newline (a last one without); a line longer
    than MAX_RECORD_BYTES (its newline not counted) is read past in pieces and left out."""
    while line := f.readline(MAX_RECORD_BYTES + 1):
        if len(line) <= MAX_RECORD_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(MAX_RECORD_BYTES)


def loads_record(line: bytes) -> dict | None:
    """The JSON object that is the whole of `line` (with or without its newline), or None: for a torn,
    empty or foreign line, one longer than MAX_RECORD_BYTES (not parsed) or one nested too deep to parse."""
    if len(line) - line.endswith(b"\n") > MAX_RECORD_BYTES:
        return None
    try:
        rec = json.loads(line)
    except NOT_JSON:
        return None
    return rec if isinstance(rec, dict) else None


def iter_records(path) -> Iterator[dict]:
    """Every line of a JSON Lines history that is a JSON object; torn, empty or foreign lines are skipped."""
    with open(path, "rb") as f:
        for line in history_lines(f):
            rec = loads_record(line)
            if rec is not None:
                yield rec


def read_loss_history(path) -> list[dict]:
    """Step records of a .loss.json, the later line winning when a step repeats (after a crash)."""
    by_step: dict[int, dict] = {}
    for rec in iter_records(path):
        if "event" not in rec and isinstance(rec.get("step"), int):
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def unfinished_phrase(state: dict) -> str | None:
    """What a report says of a run short of its program's end (its .state.json `unfinished`, `step`,
    `total_steps`), else None."""
    why, step, total = state.get("unfinished"), state.get("step"), state.get("total_steps")
    if not why or not isinstance(step, int) or not isinstance(total, int):
        return None
    if why == "cpu-max-steps":
        return f"step {step:,} of {total:,}: the first steps only (no GPU); rerun on a GPU to finish"
    return f"step {step:,} of {total:,}: unfinished (stopped by --{why})"
