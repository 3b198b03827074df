"""Token batches from a shard; the batch for step s is a pure function of (seed, s).

Scheme: the shard's tokens are cut into W = (N - 1) // T non-overlapping windows of T + 1 tokens
(window w starts at w * T; inputs are its first T tokens, targets its last T). Sample j of the run
(j = step * batch_size + i) is window perm_e[j mod W] with e = j // W and perm_e a permutation of
the W windows drawn from PCG64(seed, e): each epoch visits every window once, in a fresh order.
Resume therefore needs only the step. Validation reads windows 0, 1, 2, ... in order.
"""

from __future__ import annotations

import numpy as np

from andrea.errors import AndreaError
from andrea.shards import read_shard


class TokenWindows:
    def __init__(self, path, seq_len: int, seed: int = 0, vocab_size: int | None = None):
        self.path = path
        self.tokens = read_shard(path)
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = (self.tokens.size - 1) // seq_len
        if self.n_windows < 1:
            raise AndreaError(
                f"{path}: {self.tokens.size} tokens is fewer than one sequence of {seq_len + 1}; "
                "add data or use a shorter seq_len"
            )
        if vocab_size is not None and self.tokens.size:
            top = int(self.tokens.max())
            if top >= vocab_size:
                raise AndreaError(
                    f"{path}: token id {top} does not fit the model's vocab_size {vocab_size}; "
                    "tokenize with a tokenizer of that size"
                )
        self._perm_epoch = -1
        self._perm = None

    def _window(self, sample: int) -> int:
        epoch, index = divmod(sample, self.n_windows)
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm = rng.permutation(self.n_windows)
            self._perm_epoch = epoch
        return int(self._perm[index])

    def _gather(self, windows) -> tuple[np.ndarray, np.ndarray]:
        T = self.seq_len
        rows = np.stack([np.asarray(self.tokens[w * T: w * T + T + 1], dtype=np.int32) for w in windows])
        return rows[:, :-1].copy(), rows[:, 1:].copy()

    def train_micro_batches(self, step: int, batch_size: int, micro_batches: int, rank: int = 0, world: int = 1):
        """The step's batch (rows [rank·B/world, (rank+1)·B/world) of it on a data-parallel rank),
        split into micro_batches (tokens, targets) pairs."""
        share = batch_size // world
        first = step * batch_size + rank * share
        x, y = self._gather([self._window(first + i) for i in range(share)])
        return list(zip(np.split(x, micro_batches), np.split(y, micro_batches)))

    def val_batch(self, index: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Validation micro-batch `index`: windows in order, wrapping if the shard is short."""
        first = index * batch_size
        return self._gather([(first + i) % self.n_windows for i in range(batch_size)])
