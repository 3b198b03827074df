"""Timing on a CUDA engine (scripts/bench.py, scripts/bench_gemm.py): device-event medians, single calls
timed inside a CUDA graph, and the real schedule's op calls, recorded from one training step.

Device work is asynchronous: every time here is measured with CUDA events around the region, after
warm-up runs, as the median of several.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import NamedTuple

from andrea import ops

# The engine calls a training step is made of (andrea/engines/protocol.py): what OpRecorder records.
RECORDED = tuple(ops.CALLS)


def median_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median device time of fn() over reps runs, by CUDA events around each run."""
    import cupy

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def graph_ms(engine, fn, reps: int = 5, inner: int = 10) -> float:
    """Median device time of one fn() call, fn recorded `inner` times in one CUDA graph (no launch gaps)."""
    graph = engine.capture(lambda: [fn() for _ in range(inner)])
    return median_ms(lambda: engine.replay(graph), reps) / inner


class EngineCalls:
    """An engine that passes every call on to `engine` and routes the calls named in NAMES through `_call`:
    what a subclass does around them (record them, time them)."""

    NAMES: frozenset | tuple = RECORDED

    def __init__(self, engine):
        self.engine = engine  # the engine called

    def __getattr__(self, name):
        target = getattr(self.engine, name)
        if name not in self.NAMES:
            return target
        return lambda *args, **kwargs: self._call(name, target, args, kwargs)

    def _call(self, name, target, args, kwargs):
        return target(*args, **kwargs)


class OpRecorder(EngineCalls):
    """Records the op calls with their arguments, so that the ops of a real training step can be timed one
    by one on the step's own buffers (no second copy of the model's wiring). Build the Model on the
    recorder, run one step."""

    def __init__(self, engine):
        super().__init__(engine)
        self.calls: list[tuple[str, tuple, dict]] = []

    def _call(self, name, target, args, kwargs):
        self.calls.append((name, args, kwargs))
        return target(*args, **kwargs)

    def per_step(self) -> Counter:
        return Counter(name for name, _, _ in self.calls)

    def first_calls(self) -> dict[str, tuple[tuple, dict]]:
        """Each op's first call (the per-layer ops: layer 0's; the others have the same shapes)."""
        first: dict = {}
        for name, args, kwargs in self.calls:
            first.setdefault(name, (args, kwargs))
        return first


def fastest_peer(runs: list[dict]) -> dict:
    """The PyTorch peer's report over several processes of one variant: the fastest run's (the reading most
    favourable to the peer, whose step time moves between processes far more than within one), with every
    run's ms/step beside it as `runs_ms`, in the order they ran."""
    if not runs:
        raise ValueError("no peer run to choose from")
    best = min(runs, key=lambda r: r["ms_per_step"])
    return {**best, "runs_ms": [r["ms_per_step"] for r in runs]}


def alternating(timers: dict, rounds: int) -> dict[str, list[float]]:
    """Each timer's readings over `rounds` rounds, the timers taking turns within a round (a, b, a, b, ...): every
    one meets the card in the same run of states (a step at the card's power limit drifts in clock over a call, so
    one reading each, taken one after the other, gives the later ones another card)."""
    if rounds < 1:
        raise ValueError(f"rounds {rounds}: at least one")
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            times[name].append(timer())
    return times


class Variant(NamedTuple):
    """A benchmark variant (scripts/bench.py): PRECISION, PRECISION-eager (the step launched op by op instead of as a
    CUDA graph), PRECISION-masked (every step under a loss mask) or PRECISION-mma (no warpgroup kernels: the build
    every sm_80+ card runs)."""
    precision: str
    eager: bool
    masked: bool
    mma: bool

    @property
    def plain(self) -> bool:
        """The precision as the trainer runs it (the variant whose ops the benchmark times one by one)."""
        return not (self.eager or self.masked or self.mma)


def variant_parts(variant: str) -> Variant:
    precision, _, kind = variant.partition("-")
    return Variant(precision, kind == "eager", kind == "masked", kind == "mma")


# The PyTorch peers an engine precision's bar is judged against, the fastest of them that ran counting: bf16 autocast
# under torch.compile, and for fp8 also torchao's float8 training under torch.compile (at some shapes slower than its
# bf16, so the faster of the two is the one to beat)
BAR_PEERS = {"bf16": ("bf16-compile",), "fp8": ("bf16-compile", "fp8-compile")}


def bar_peer(bench: dict, shape: str, precision: str) -> str | None:
    """The peer variant that counts for an engine precision at a shape: the fastest of BAR_PEERS[precision] in the
    report's `bench` section; None where none of them ran."""
    ran = [p for p in BAR_PEERS.get(precision, ()) if bench.get("baseline", {}).get(f"{shape}/{p}")]
    return min(ran, key=lambda p: bench["baseline"][f"{shape}/{p}"]["ms_per_step"], default=None)


def peer_pairs(bench: dict):
    """Each engine variant of a benchmark report's `bench` section beside the PyTorch variants it is compared with:
    the same precision in plain PyTorch, and for the plain precision and its -mma variant (the kernels every sm_80+
    card runs) also BAR_PEERS. A -masked variant has no peer (the peer trains without a loss mask).
    Yields (shape, variant, engine entry, peer variant, peer entry or {} when it did not run, whether the peer is
    the one that counts: bar_peer)."""
    for key, entry in bench.get("engine", {}).items():
        shape, variant = key.split("/")
        v = variant_parts(variant)
        if v.masked:
            continue
        barred = v.plain or v.mma
        peers = [v.precision] + (list(BAR_PEERS.get(v.precision, ())) if barred else [])
        counted = bar_peer(bench, shape, v.precision) if barred else None
        for peer in peers:
            yield shape, variant, entry, peer, bench.get("baseline", {}).get(f"{shape}/{peer}", {}), peer == counted


def against_bf16(bench: dict):
    """Each engine variant of a benchmark report's `bench` section that is not bf16, beside the engine's bf16 step of
    the same shape in the same call (precision fp8's bar is a ratio to it). Yields (shape, variant, tokens/s of the
    variant over bf16's); a shape whose bf16 step did not run yields nothing."""
    engine = bench.get("engine", {})
    for key, entry in engine.items():
        shape, variant = key.split("/")
        base = engine.get(f"{shape}/bf16")
        if variant != "bf16" and base:
            yield shape, variant, entry["tokens_per_s"] / base["tokens_per_s"]
