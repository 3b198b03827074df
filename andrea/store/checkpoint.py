"""Checkpoints in the seed's exact binary format, written atomically.

    [int32 step][int32 n_params][n_params x float32 weights][n_params x float32 m][n_params x float32 v]

Little-endian, no padding, nothing else. `step` = optimizer steps completed. What the format cannot
hold lives in the `.state.json` sidecar (see `andrea.run.run_book`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from andrea.common.atomic import atomic_write
from andrea.common.errors import AndreaError
from andrea.common.hashing import sha256_file
from andrea.store.runfiles import BEST_SUFFIX, RunFiles

HEADER = np.dtype([("step", "<i4"), ("n_params", "<i4")])
HEADER_BYTES = HEADER.itemsize
FLOAT = np.dtype("<f4")


def checkpoint_bytes(n_params: int) -> int:
    return HEADER_BYTES + 3 * n_params * FLOAT.itemsize


def _parts(step: int, params, m, v) -> list[np.ndarray]:
    n = params.size
    if not (m.size == v.size == n):
        raise ValueError("params, m and v must have the same size")
    return [np.array([(step, n)], dtype=HEADER)] + [np.ascontiguousarray(x, dtype=FLOAT) for x in (params, m, v)]


def checkpoint_digest(step: int, params, m, v) -> str:
    """sha256 of the bytes write_checkpoint writes for this state."""
    digest = hashlib.sha256()
    for part in _parts(step, params, m, v):
        digest.update(memoryview(part).cast("B"))
    return digest.hexdigest()


def write_checkpoint(path, step: int, params, m, v) -> None:
    """Write atomically: a reader sees the old file or the new one, never a torn one."""
    parts = _parts(step, params, m, v)
    with atomic_write(path) as f:
        for part in parts:
            f.write(memoryview(part).cast("B"))


def read_header(path) -> tuple[int, int]:
    """(step, n_params) after checking the file is exactly a checkpoint of that size."""
    path = Path(path)
    if not path.is_file():
        raise AndreaError(f"{path}: checkpoint not found")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise AndreaError(f"{path}: {size} bytes is too short to be a checkpoint (header is {HEADER_BYTES} bytes)")
    header = np.fromfile(path, dtype=HEADER, count=1)[0]
    step, n = int(header["step"]), int(header["n_params"])
    if n <= 0 or step < 0:
        raise AndreaError(
            f"{path}: not a checkpoint: its header reads step={step}, n_params={n} (both must be "
            "non-negative, n_params positive); the file is damaged or not an ANDREA checkpoint"
        )
    if size != checkpoint_bytes(n):
        raise AndreaError(
            f"{path}: not a checkpoint: {size:,} bytes, but a header of n_params={n:,} needs "
            f"8 + 12*n_params = {checkpoint_bytes(n):,} bytes (truncated or not an ANDREA checkpoint)"
        )
    return step, n


def map_checkpoint(path, expected_n_params: int | None = None, what: str = "this experiment"):
    """Return (step, params, m, v) as read-only float32 memory maps of the file (nothing loaded)."""
    step, n = read_header(path)
    if expected_n_params is not None and n != expected_n_params:
        raise AndreaError(
            f"{path}: checkpoint holds {n:,} parameters but {what} has {expected_n_params:,}; "
            "it belongs to another model shape"
        )
    body = np.memmap(path, dtype=FLOAT, mode="r", offset=HEADER_BYTES, shape=(3 * n,))
    return step, body[:n], body[n:2 * n], body[2 * n:]


def read_checkpoint(path, expected_n_params: int | None = None, what: str = "this experiment"):
    """Return (step, params, m, v) as float32 arrays in memory."""
    step, *vectors = map_checkpoint(path, expected_n_params, what)
    return (step, *(np.array(v) for v in vectors))


def read_finite_weights(path, layout, what: str):
    """(step, params) of a checkpoint for inference: weights with a NaN or infinity (a run that
    diverged) would sample from NaN probabilities or export NaN tensors, so they are refused."""
    step, params, _, _ = map_checkpoint(path, layout.n_params, what)
    params = np.array(params)
    bad = ~np.isfinite(params)
    if bad.any():
        tensors = [t.name for t in layout.tensors if bad[t.offset:t.end].any()]
        raise AndreaError(
            f"{path}: {int(bad.sum()):,} of its {params.size:,} weights are NaN or infinite (in {', '.join(tensors[:4])}"
            f"{', ...' if len(tensors) > 4 else ''}); the run had diverged by step {step}; use an earlier checkpoint"
        )
    return step, params


def state_path(ckpt) -> Path:
    """The `.state.json` that speaks for a checkpoint: NAME.state.json beside NAME.ckpt, and for NAME.best.ckpt
    the run's NAME.state.json (its `best` entry vouches for it), unless a NAME.best.state.json lies there."""
    ckpt = Path(ckpt)
    own = RunFiles(ckpt).state
    if ckpt.name.endswith(BEST_SUFFIX) and not own.is_file():
        return RunFiles(ckpt.with_name(ckpt.name[: -len(BEST_SUFFIX)] + ".ckpt")).state
    return own


def is_best(ckpt, state: dict | None) -> bool:
    """True when `ckpt` is a run's NAME.best.ckpt read through the run's state."""
    ckpt = Path(ckpt)
    return ckpt.name.endswith(BEST_SUFFIX) and state_path(ckpt) != RunFiles(ckpt).state


def read_state(ckpt) -> dict | None:
    """The `.state.json` that speaks for a checkpoint (state_path), or None when there is none."""
    path = state_path(ckpt)
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise AndreaError(f"{path}: not valid JSON (line {err.lineno}: {err.msg}); it was damaged or hand-edited") from None
    except UnicodeDecodeError:
        raise AndreaError(f"{path}: not UTF-8 text; it was damaged or hand-edited") from None
    except RecursionError:
        raise AndreaError(f"{path}: nested deeper than a run's state ever is; it was damaged or hand-edited") from None
    if not isinstance(state, dict):
        raise AndreaError(f"{path}: not a run's state (a JSON object); it was damaged or hand-edited")
    return state


def recorded_sha256s(state: dict | None, ckpt=None) -> set[str]:
    """sha256 of the checkpoints a .state.json vouches for: its recent checkpoints, or for the run's
    NAME.best.ckpt (`ckpt`) its best entry."""
    if ckpt is not None and is_best(ckpt, state):
        # best_previous: the best before, while the state already names the one being written
        return {b["sha256"] for b in ((state or {}).get("best"), (state or {}).get("best_previous")) if b}
    return {c["sha256"] for c in (state or {}).get("checkpoints", [])}


def vouches(ckpt, state: dict | None, digest: str) -> bool | None:
    """Whether the state that speaks for `ckpt` vouches for the file of sha256 `digest`; None when no state speaks
    for it, or one that records no checkpoint (written by hand, or by another tool) and so vouches for none."""
    recorded = recorded_sha256s(state, ckpt)
    if state is None or not (recorded or is_best(ckpt, state)):
        return None
    return digest in recorded


def verify_against_state(path) -> None:
    """If a .state.json speaks for the checkpoint, it must vouch for it (vouches)."""
    state = read_state(path)
    if state is None or not (recorded_sha256s(state, path) or is_best(path, state)):
        return
    digest = sha256_file(path)
    if not vouches(path, state, digest):
        what = "the best checkpoint it records" if is_best(path, state) else "any checkpoint it records"
        raise AndreaError(
            f"{path}: sha256 {digest[:16]}… is not {what} ({state_path(path)}); "
            "the checkpoint was modified or damaged, or written after the state"
        )


def untrusted_values(params, m, v) -> str | None:
    """What makes a state unfit to train on or to write, in words, or None: weights and Adam's m must be
    finite, v finite and non-negative. A NaN there is carried into every later update while the loss and the
    gradient norm can still read finite."""
    for name, vec, ok in (("weights", params, np.isfinite), ("m", m, np.isfinite),
                          ("v", v, lambda x: np.isfinite(x) & (x >= 0))):
        bad = ~ok(vec)
        if bad.any():
            first = int(np.argmax(bad))
            return (f"{int(bad.sum()):,} of the {vec.size:,} values of {name} are "
                    f"{'NaN, infinite or negative' if name == 'v' else 'NaN or infinite'} "
                    f"(the first at index {first:,}: {vec[first]})")
    return None


def check_trainable(path, params, m, v) -> None:
    """A checkpoint read to train on (--init-from, --resume) must hold numbers that can be trusted."""
    fault = untrusted_values(params, m, v)
    if fault:
        raise AndreaError(f"{path}: {fault}; it cannot be trained on; use an earlier checkpoint")
