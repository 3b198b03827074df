"""The Firehose: how much of each data source a step draws (docs/FIREHOSE-BANDIT.md is the spec).

An experiment (or a phase) with `"mixing": {"policy": ...}` draws each step's batch from the
sources by probabilities the policy sets before the step: `uniform`, `proportional` (to each
source's windows), `fixed` (given weights) or `bandit` (EXP3 with decaying exploration over the
sources' training losses, after Online Data Mixing, Albalak et al. 2023). Without `mixing` the
loader's own scheme runs (andrea/store/loader.py: one permutation over the windows of all sources).

The batch of step s is a pure function of (seed, s, MixState): systematic sampling of the B rows'
sources from the probabilities with one uniform from PCG64(seed, MIX_STREAM, s), then each
source's next windows from its own permutation stream. MixState is small (a few numbers per
source) and goes into `.state.json` with every checkpoint, so a resume restores it exactly.
Everything here is float64 Python arithmetic in source order (math.exp, no vectorised maths), so the
probabilities do not depend on the machine's SIMD width or thread count.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from andrea.common.errors import AndreaError

MIX_STREAM = 0x6D6978  # "mix": the PCG64 streams of mixed batches, apart from the loader's (seed, epoch)
POLICIES = ("uniform", "proportional", "fixed", "bandit")
REWARDS = ("loss", "progress")
BANDIT_DEFAULTS = {"reward": "progress", "smoothing": 0.9, "scale": 1.0}


@dataclass
class MixState:
    """What the mixture remembers between steps (per source, in the loader's source order)."""

    draws: list[int]  # windows drawn from the source so far: its next draw is number draws[k]
    reward: list[float]  # the bandit's smoothed importance-weighted reward R_k
    loss_mean: list[float | None]  # running mean of the source's training loss (the progress reward's baseline)
    updates: int = 0  # bandit updates so far (t)
    rows: list[int] = field(default_factory=list)  # sequences drawn and trained on, per source

    @classmethod
    def fresh(cls, n_sources: int) -> "MixState":
        return cls([0] * n_sources, [0.0] * n_sources, [None] * n_sources, 0, [0] * n_sources)

    def to_json(self) -> dict:
        return {"draws": list(self.draws), "reward": list(self.reward), "loss_mean": list(self.loss_mean),
                "updates": self.updates, "rows": list(self.rows)}

    @classmethod
    def from_json(cls, raw: dict, n_sources: int) -> "MixState":
        state = cls([int(x) for x in raw["draws"]], [float(x) for x in raw["reward"]],
                    [None if x is None else float(x) for x in raw["loss_mean"]], int(raw["updates"]),
                    [int(x) for x in raw["rows"]])
        if len(state.draws) != n_sources:
            raise ValueError(f"a mixing state of {len(state.draws)} sources for {n_sources}")
        return state

    def copy(self) -> "MixState":
        return MixState.from_json(self.to_json(), len(self.draws))


def exploration(t: int, k: int) -> float:
    """EXP3's exploration rate after t updates over k arms: min(1/k, sqrt(ln k / (k t))), 1/k at t = 0."""
    if k <= 1:
        return 0.0
    return 1.0 / k if t == 0 else min(1.0 / k, math.sqrt(math.log(k) / (k * t)))


def bandit_probabilities(reward: list[float], arms: list[int], t: int, n_sources: int) -> list[float]:
    """pi_k = (1 - K eps_{t+1}) softmax_k(eps_t R) + eps_{t+1} over the arms, 0 elsewhere."""
    k = len(arms)
    probs = [0.0] * n_sources
    eps_now, eps_next = exploration(t, k), exploration(t + 1, k)
    top = max(eps_now * reward[a] for a in arms)
    weights = [math.exp(eps_now * reward[a] - top) for a in arms]
    total = math.fsum(weights)
    for a, w in zip(arms, weights):
        probs[a] = (1.0 - k * eps_next) * (w / total) + eps_next
    return probs


def bandit_update(state: MixState, probs: list[float], source_loss: dict[int, float], params: dict) -> None:
    """After a step: for each source k the step drew, with mean training loss L_k, the reward r_k
    (`loss`: L_k; `progress`: 100 (m_k - L_k) / m_k, the percentage drop below the source's running
    mean m_k, 0 at its first draw), then R_k <- a R_k + (1 - a) scale r_k / pi_k and
    m_k <- a m_k + (1 - a) L_k, a = smoothing. Sources not drawn keep R_k and m_k. t <- t + 1."""
    a, scale = params["smoothing"], params["scale"]
    for k in sorted(source_loss):
        loss = source_loss[k]
        mean = state.loss_mean[k]
        if params["reward"] == "loss":
            r = loss
        else:
            r = 0.0 if mean is None else 100.0 * (mean - loss) / mean
        state.reward[k] = a * state.reward[k] + (1.0 - a) * scale * r / probs[k]
        state.loss_mean[k] = loss if mean is None else a * mean + (1.0 - a) * loss
    state.updates += 1


def systematic_rows(probs: list[float], u0: float, batch_size: int) -> list[int]:
    """The source of each of the B rows: row i takes the first source k with (i + u0) / B < c_k, c_k the
    running sum of the probabilities (the last source in play closes at infinity)."""
    last = max(k for k, p in enumerate(probs) if p > 0)
    bounds, c = [], 0.0
    for k, p in enumerate(probs):
        c += p
        bounds.append(math.inf if k >= last else c)
    rows, k = [], 0
    for i in range(batch_size):
        u = (i + u0) / batch_size
        while u >= bounds[k]:
            k += 1
        rows.append(k)
    return rows


class Mixture:
    """The mixing of a run over the train windows' sources: the policy of each phase, the probabilities
    before a step, the step's batch, and the state's update after it."""

    def __init__(self, windows, program, seed: int, batch_size: int, where: str):
        self.windows = windows
        self.seed, self.batch_size = seed, batch_size
        self.names = [name or "data" for name in windows.sources]
        self.per_source = [windows.source_windows(k) for k in range(len(self.names))]
        self._passes: dict[int, tuple[int, np.ndarray]] = {}  # source -> (pass, its permutation): the current one
        self.policies = {phase.name: self._check(phase.mixing, f"{where}: phase {phase.name!r}")
                         for phase in program.phases}

    @property
    def active(self) -> bool:
        return any(p is not None for p in self.policies.values())

    def _check(self, spec: dict | None, where: str) -> dict | None:
        if spec is None:
            return None
        spec = dict(spec)
        if spec["policy"] == "bandit":
            spec = {**BANDIT_DEFAULTS, **spec}
        named = spec.get("sources")
        for name in list(named or ()) + list(spec.get("weights", {})):
            if name not in self.names:
                raise AndreaError(f"{where}: field 'mixing' names the source {name!r}, which the data does not have "
                                  f"(its sources: {', '.join(self.names)}); fix the name or tokenize that source")
        arms = [k for k, n in enumerate(self.names) if named is None or n in named]
        if spec["policy"] == "fixed":
            weights = spec["weights"]
            arms = [k for k in arms if weights.get(self.names[k], 0) > 0]
            if not arms:
                raise AndreaError(f"{where}: field 'mixing.weights' gives no source a weight above 0; give one a weight")
        for k in arms:
            if self.per_source[k] == 0:
                shard = self.windows.shards[k]
                raise AndreaError(
                    f"{where}: the source {self.names[k]!r} ({shard}) has {self.windows.source_tokens(k)} tokens, fewer "
                    f"than one sequence of {self.windows.seq_len + 1}, so it can give no batch; add data to it, leave "
                    "it out of 'mixing.sources', or give it weight 0 in a fixed mix")
        spec["arms"] = arms
        return spec

    # ---- before the step -------------------------------------------------------------------------
    def probabilities(self, phase, state: MixState) -> list[float]:
        spec = self.policies[phase.name]
        n, arms = len(self.names), spec["arms"]
        probs = [0.0] * n
        policy = spec["policy"]
        if policy == "bandit":
            return bandit_probabilities(state.reward, arms, state.updates, n)
        if policy == "uniform":
            weights = {k: 1.0 for k in arms}
        elif policy == "proportional":
            weights = {k: float(self.per_source[k]) for k in arms}
        else:
            weights = {k: float(spec["weights"][self.names[k]]) for k in arms}
        total = math.fsum(weights.values())
        for k, w in weights.items():
            probs[k] = w / total
        return probs

    def batch(self, step: int, probs: list[float], state: MixState) -> tuple[list[int], list[int]]:
        """(windows, sources) of the step's B rows; advances state.draws."""
        u0 = float(np.random.Generator(np.random.PCG64([self.seed, MIX_STREAM, step])).random())
        sources = systematic_rows(probs, u0, self.batch_size)
        windows = []
        for k in sources:
            windows.append(self._window(k, state.draws[k]))
            state.draws[k] += 1
        return windows, sources

    def _window(self, k: int, n: int) -> int:
        """The source's n-th draw: its windows in a fresh permutation per pass, from PCG64(seed, MIX_STREAM,
        crc32(name), pass), so a source's order does not depend on which other sources are there."""
        epoch, index = divmod(n, self.per_source[k])
        if self._passes.get(k, (None,))[0] != epoch:
            stream = zlib.crc32(self.names[k].encode())
            rng = np.random.Generator(np.random.PCG64([self.seed, MIX_STREAM, stream, epoch]))
            self._passes[k] = (epoch, rng.permutation(self.per_source[k]))
        perm = self._passes[k][1]
        return int(self.windows.window_offsets[k] + perm[index])

    # ---- after the step --------------------------------------------------------------------------
    def update(self, phase, state: MixState, probs: list[float], source_loss: dict[int, float]) -> None:
        spec = self.policies[phase.name]
        if spec is not None and spec["policy"] == "bandit":
            bandit_update(state, probs, source_loss, spec)

    def named(self, values) -> dict:
        """{source name: value} for a per-source sequence or {index: value} mapping (None values left out)."""
        items = values.items() if isinstance(values, dict) else enumerate(values)
        return {self.names[k]: v for k, v in items if v is not None}
