"""Where one real training step's device time goes, op by op, measured inside the step itself.

    PYTHONPATH=. python3 scripts/step_profile.py [--shapes 12M,120M] [--precisions bf16,fp8,fp8-masked] [--out DIR]

scripts/bench.py times each op alone in a CUDA graph, outside the step: an fp8 op timed so runs every amax
pass the step's pass book would have spared it. Here the step runs eagerly, as the trainer's first step does
(`graphs=False`, the same Python path the graph captures), and every engine op call is bracketed by CUDA
events. Before each call the stream runs a spin kernel of SPIN_US microseconds, so the host has enqueued the
op's kernels by the time the device reaches them: the time between the events is the op's own device time,
without host launch gaps. Timed beside the ops: `zero`, `zero_grads` and the weight copies (`prepare_fp8_weights`,
`prepare_qkv_rows`). The table gives each op's calls a step, total ms and share; their sum is set
against the same step replayed as CUDA graphs (scripts/bench.py's per_step_ms). Run on a CUDA machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench import BENCH, EXPERIMENTS, engine_for, options, per_step_ms  # noqa: E402

from andrea.schedule.crosscheck import OPTIMIZER, loss_masks, lr_at, synthetic_micro_batches  # noqa: E402
from andrea.schedule.timing import RECORDED, EngineCalls, variant_parts  # noqa: E402

# the ops, and the step's engine calls beside them: the weight gradients' zeroing, the weight copies
TIMED = frozenset((*RECORDED, "zero", "zero_grads", "prepare_fp8_weights", "prepare_qkv_rows"))
SPIN_US = 300  # longer than the host takes to launch any one op's kernels (a few to a dozen, ~5 us each)
SPIN = r"""extern "C" __global__ void k_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}"""


class OpTimer(EngineCalls):
    """Brackets the TIMED calls with CUDA events, after a spin (while `on`)."""

    NAMES = TIMED

    def __init__(self, engine, spin_cycles: int):
        import cupy

        super().__init__(engine)
        self._spin = cupy.RawKernel(SPIN, "k_spin")
        self._cycles = spin_cycles
        self.events: list[tuple[str, object, object]] = []
        self.on = False

    def _call(self, name, target, args, kwargs):
        import cupy

        if not self.on:
            return target(*args, **kwargs)
        stream = cupy.cuda.get_current_stream()
        self._spin((1,), (1,), (cupy.int64(self._cycles),), stream=stream)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        out = target(*args, **kwargs)
        end.record(stream)
        self.events.append((name, start, end))
        return out

    def per_op(self) -> dict[str, dict]:
        import cupy

        self.engine.synchronize()
        total, calls = defaultdict(float), defaultdict(int)
        for name, start, end in self.events:
            total[name] += cupy.cuda.get_elapsed_time(start, end)
            calls[name] += 1
        return {name: {"calls": calls[name], "ms": round(total[name], 4)} for name in total}


def spin_cycles() -> int:
    import cupy

    khz = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"]
    return int(SPIN_US * khz / 1e3)


def profile(name: str, variant: str, steps: int) -> dict:
    from andrea.schedule.model import Model, init_params

    masked = variant_parts(variant).masked
    shape, micro = EXPERIMENTS[name].model, BENCH[name]
    engine = engine_for(variant)
    timer = OpTimer(engine, spin_cycles())
    model = Model(timer, shape, micro, graphs=True, **options(name))
    model.load_state(init_params(model.layout, 0))
    graph_ms = per_step_ms(model, masked=masked)
    model.graphs = False
    per_step = []
    for step in range(steps):
        timer.events.clear()
        timer.on = step > 0  # the first eager step warms what eager runs differently
        batches = synthetic_micro_batches(shape, micro, 1, step)
        model.train_step(batches, step=step, lr=lr_at(step), optimizer=OPTIMIZER,
                         weights=loss_masks(batches, step) if masked else None)
        if timer.on:
            per_step.append(timer.per_op())
    # the median over the timed steps, op by op
    ops = {}
    for op in per_step[0]:
        ops[op] = {"calls": per_step[0][op]["calls"], "ms": statistics.median(s[op]["ms"] for s in per_step)}
    return {"graph_step_ms": round(graph_ms, 3), "ops_sum_ms": round(sum(v["ms"] for v in ops.values()), 3),
            "ops": ops}


def table(results: dict) -> str:
    keys = list(results)
    ops = list(dict.fromkeys(op for r in results.values() for op in r["ops"]))
    lines = ["| op | " + " | ".join(f"{k} calls · ms · share" for k in keys) + " |",
             "|---|" + "---:|" * len(keys)]
    for op in ops:
        cells = []
        for k in keys:
            v = results[k]["ops"].get(op)
            cells.append("" if v is None else f"{v['calls']} · {v['ms']:.3f} · {v['ms'] / results[k]['ops_sum_ms']:.0%}")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines.append("| sum of ops | " + " | ".join(f"{results[k]['ops_sum_ms']:.3f}" for k in keys) + " |")
    lines.append("| step as graphs | " + " | ".join(f"{results[k]['graph_step_ms']:.3f}" for k in keys) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shapes", default="12M,120M", help="comma-separated: 12M, 120M (default both)")
    ap.add_argument("--precisions", default="bf16,fp8",
                    help="comma-separated precisions (default bf16,fp8); PRECISION-masked: each step under a loss mask")
    ap.add_argument("--steps", type=int, default=4, help="eager steps; the first is not timed (default 4)")
    ap.add_argument("--out", type=Path, help="folder for step_profile.json")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2: the first step is not timed")
    shapes, precisions = args.shapes.split(","), args.precisions.split(",")
    for bad in set(shapes) - set(BENCH):
        ap.error(f"--shapes: unknown shape {bad!r}; choose from {', '.join(BENCH)}")
    results = {}
    for name in shapes:
        for precision in precisions:
            results[f"{name}/{precision}"] = r = profile(name, precision, args.steps)
            print(f"{name}/{precision}: ops {r['ops_sum_ms']:.3f} ms, step as graphs {r['graph_step_ms']:.3f} ms",
                  flush=True)
    print(table(results))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_profile.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
