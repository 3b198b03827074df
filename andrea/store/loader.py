"""Token batches from the shards of one or more sources; the batch for step s is a pure function of
(seed, s).

A data folder is either one source (DIR/train.bin, DIR/val.bin: the single-folder layout) or a
folder of sources (DIR/<name>/train.bin, ..., as `andrea tokenize --source` writes them), read in
name order; `TokenWindows(DIR/train.bin, ...)` finds the sources beside that path.

Scheme: each source's tokens are cut into W_k = (N_k - 1) // T non-overlapping windows of T + 1
tokens (window w starts at w * T; inputs are its first T tokens, targets its last T). The windows
of all sources share one index space, source after source (so no window crosses a source boundary,
and each source is drawn in proportion to its tokens); W = sum W_k. Sample j of the run
(j = step * batch_size + i) is window perm_e[j mod W] with e = j // W and perm_e a permutation of
the W windows drawn from PCG64(seed, e): each epoch visits every window once, in a fresh order.
Resume therefore needs only the step. With one source this is exactly the single-shard scheme.
An experiment with `mixing` draws its batches by andrea.store.mixing instead (docs/FIREHOSE-BANDIT.md);
`micro_batches_of` / `micro_weights_of` read any list of windows.
Validation scores `val_windows(n)`: n windows evenly spaced over all W of the split (or over one
source's), so every source is scored by its share of the windows (docs/EVAL.md).

Loss masks (DIR/<name>/train.mask.bin beside each shard, see andrea.store.shards): the target weights of
a batch, aligned with its targets, come from `train_micro_weights` / `micro_weights_of`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from andrea.common.errors import AndreaError
from andrea.store.manifest import manifest_path, read_manifest
from andrea.store.shards import mask_path, read_mask, read_shard


def source_shards(path) -> list[tuple[str | None, Path]]:
    """(source name, shard) pairs for `path` = DIR/<split>.bin, in name order: the sources that
    `andrea tokenize --source` wrote together (its union shard's manifest names them, so a folder
    left from an earlier configuration is not read), else every DIR/<name>/<split>.bin; with no
    source folders, [(None, path)]: the single-folder layout."""
    path = Path(path)
    folder = path.parent
    if manifest_path(path).is_file():
        names = read_manifest(path)["config"].get("sources")
        if names:
            return [(name, folder / name / path.name) for name in sorted(names)]
    found = sorted(p for p in folder.glob(f"*/{path.name}") if p.is_file()) if folder.is_dir() else []
    return [(p.parent.name, p) for p in found] or [(None, path)]


class ConcatenatedTokens:
    """The tokens of several shards read as one sequence (what `.tokens` is for a folder of
    sources), without copying them into memory until asked for as an array."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.starts = np.cumsum([0] + [p.size for p in parts])
        self.size = int(self.starts[-1])
        self.dtype = parts[0].dtype
        self.shape = (self.size,)

    def __len__(self) -> int:
        return self.size

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate([np.asarray(p) for p in self.parts])
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, index):
        if not isinstance(index, slice):
            i = int(index) + (self.size if int(index) < 0 else 0)
            k = int(np.searchsorted(self.starts, i, side="right")) - 1
            return self.parts[k][i - self.starts[k]]
        start, stop, step = index.indices(self.size)
        if step != 1:
            return np.asarray(self)[index]
        pieces = [np.asarray(part[max(start, a) - a: min(stop, b) - a])
                  for part, a, b in zip(self.parts, self.starts[:-1], self.starts[1:]) if max(start, a) < min(stop, b)]
        return np.concatenate(pieces) if pieces else np.empty(0, self.dtype)


class TokenWindows:
    def __init__(self, path, seq_len: int, seed: int = 0, vocab_size: int | None = None):
        self.path = path
        found = source_shards(path)
        self.sources = [name for name, _ in found]
        self.shards = [shard for _, shard in found]
        parts = [read_shard(shard) for shard in self.shards]
        self.tokens = parts[0] if len(parts) == 1 else ConcatenatedTokens(parts)
        self._parts = parts
        self.seq_len = seq_len
        self.seed = seed
        per_source = np.array([max(0, (p.size - 1) // seq_len) for p in parts], dtype=np.int64)
        self.window_offsets = np.concatenate([[0], np.cumsum(per_source)])  # source k: [off[k], off[k+1])
        self.n_windows = int(self.window_offsets[-1])
        if self.n_windows < 1:
            if len(parts) == 1:
                raise AndreaError(
                    f"{path}: {parts[0].size} tokens is fewer than one sequence of {seq_len + 1}; "
                    "add data or use a shorter seq_len"
                )
            raise AndreaError(
                f"{path}: none of its sources ({', '.join(self.sources)}) has one sequence of {seq_len + 1} "
                "tokens; add data or use a shorter seq_len"
            )
        if vocab_size is not None:
            for shard, part in zip(self.shards, parts):
                top = int(part.max()) if part.size else -1
                if top >= vocab_size:
                    raise AndreaError(
                        f"{shard}: token id {top} does not fit the model's vocab_size {vocab_size}; "
                        "tokenize with a tokenizer of that size"
                    )
        # read (and their values checked) at open: a bad mask stops a run before its first step, not at its first eval
        self._masks = self._read_masks() if self.has_masks else None
        self._perm_epoch = -1
        self._perm = None

    # ---- which window ------------------------------------------------------------------------
    def _window(self, sample: int) -> int:
        epoch, index = divmod(sample, self.n_windows)
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm = rng.permutation(self.n_windows)
            self._perm_epoch = epoch
        return int(self._perm[index])

    def window_source(self, window: int) -> int:
        """Index (into `sources`) of the source a window lies in."""
        return int(np.searchsorted(self.window_offsets, window, side="right")) - 1

    def _start(self, window: int) -> tuple[int, int]:
        k = self.window_source(window)
        return k, int(window - self.window_offsets[k]) * self.seq_len

    def batch_windows(self, step: int, batch_size: int) -> list[int]:
        """The windows of the step's B rows under this scheme (andrea.store.mixing draws them otherwise)."""
        return [self._window(step * batch_size + i) for i in range(batch_size)]

    def _train_windows(self, step: int, batch_size: int, rank: int, world: int) -> list[int]:
        return rank_rows(self.batch_windows(step, batch_size), rank, world)

    def val_windows(self, count: int, source: int | None = None) -> list[int]:
        """The windows validation scores, in order: n = min(count, W) of the split's W windows (of one source's
        with `source`), window (2j + 1) W // 2n for j < n. Evenly spaced (a step of W / n >= 1), so distinct and
        each source scored by its share of the windows; n = W gives every window once."""
        if source is None:
            start, W = 0, self.n_windows
        else:
            start, W = int(self.window_offsets[source]), self.source_windows(source)
        n = min(count, W)
        return [start + (2 * j + 1) * W // (2 * n) for j in range(n)]

    @property
    def files(self) -> list[Path]:
        """What the split is read from, as the run's records name it: DIR/<split>.bin (one source, or the
        union of several) where it exists, else each source's shard (a folder of sources without a union)."""
        return [Path(self.path)] if Path(self.path).is_file() else list(self.shards)

    def source_tokens(self, source: int) -> int:
        """How many tokens the source's shard has."""
        return int(self._parts[source].size)

    def source_windows(self, source: int) -> int:
        """How many windows the source has."""
        return int(self.window_offsets[source + 1] - self.window_offsets[source])

    # ---- tokens ------------------------------------------------------------------------------
    def _gather(self, windows) -> tuple[np.ndarray, np.ndarray]:
        T = self.seq_len
        rows = []
        for w in windows:
            k, start = self._start(w)
            rows.append(np.asarray(self._parts[k][start: start + T + 1], dtype=np.int32))
        rows = np.stack(rows)
        return rows[:, :-1].copy(), rows[:, 1:].copy()

    def micro_batches_of(self, windows: list[int], micro_batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The windows (this rank's rows) as micro_batches (tokens, targets) pairs."""
        x, y = self._gather(windows)
        return list(zip(np.split(x, micro_batches), np.split(y, micro_batches)))

    def train_micro_batches(self, step: int, batch_size: int, micro_batches: int, rank: int = 0, world: int = 1):
        """The step's batch (rows [rank·B/world, (rank+1)·B/world) of it on a data-parallel rank),
        split into micro_batches (tokens, targets) pairs."""
        return self.micro_batches_of(self._train_windows(step, batch_size, rank, world), micro_batches)

    def train_sources(self, step: int, batch_size: int, rank: int = 0, world: int = 1) -> np.ndarray:
        """The source index of each sequence of the step's batch (this rank's rows)."""
        return np.array([self.window_source(w) for w in self._train_windows(step, batch_size, rank, world)])

    # ---- loss masks --------------------------------------------------------------------------
    @property
    def has_masks(self) -> bool:
        return all(mask_path(shard).is_file() for shard in self.shards)

    def _read_masks(self) -> list[np.ndarray]:
        """Each shard's loss mask; read_mask refuses one that does not cover its shard or holds a value other
        than 0 or 1."""
        missing = [str(mask_path(s)) for s in self.shards if not mask_path(s).is_file()]
        if missing:
            raise AndreaError(f"{missing[0]}: no loss mask beside the shard; rerun `andrea tokenize`")
        return [read_mask(mask_path(s), part.size) for s, part in zip(self.shards, self._parts)]

    def _weights(self, windows) -> np.ndarray:
        if self._masks is None:
            self._masks = self._read_masks()
        T = self.seq_len
        rows = []
        for w in windows:
            k, start = self._start(w)
            rows.append(np.asarray(self._masks[k][start + 1: start + T + 1], dtype=np.float32))
        return np.stack(rows)

    def micro_weights_of(self, windows: list[int], micro_batches: int) -> list[np.ndarray]:
        """Target weights (0/1, float32) of each micro-batch of `micro_batches_of(windows, ...)`, same
        shapes as its targets: weights[b, t] = mask[start_b + 1 + t]."""
        return np.split(self._weights(windows), micro_batches)

    def train_micro_weights(self, step: int, batch_size: int, micro_batches: int, rank: int = 0,
                            world: int = 1) -> list[np.ndarray]:
        """Target weights of each micro-batch of `train_micro_batches`."""
        return self.micro_weights_of(self._train_windows(step, batch_size, rank, world), micro_batches)


def rank_rows(rows: list, rank: int, world: int) -> list:
    """A data-parallel rank's share of a step's rows: [rank·B/world, (rank+1)·B/world)."""
    share = len(rows) // world
    return rows[rank * share: (rank + 1) * share]
