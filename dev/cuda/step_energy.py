"""Energy a training step, the engine's and the PyTorch peer's: whether a step is bound by the card's power cap.

    PYTHONPATH=. python3 dev/cuda/step_energy.py [--shape 120M] [--precisions bf16,fp8] [--steps 200]
        [--baseline PATH]

NVML's energy counter and SM clock are sampled every 20 ms in a thread while the benchmark's step
(scripts/bench.py's model, one micro-batch) runs --steps steps back to back after 20, in each precision, and then
while the peer (`--baseline`, default $ANDREA_PEER_BASELINE; `none` skips it) runs its bf16 + torch.compile step in
a process of its own, --steps timed steps. A line each: ms a step (the median), the mean power over the timed steps
(the counter's rise over their span), mJ a step (the two multiplied) and the SM clock's median and minimum. On a
card held at its power limit, time a step is energy a step over that limit, so only less energy makes the step
faster; a step below the limit still gains from a faster kernel. It reports and does not judge.

With --ops, the first precision's ops are then metered one by one (dev/cuda/sustained_gemm.py's `sustained`: each
op's first call of a step replayed from a graph on the step's own buffers until the card settles, then timed and
metered over --op-window seconds): ms, W and mJ a call, and mJ a step by its calls a step, largest first, so
that the ops drawing the card's limit and those below it, and where a step's energy goes, can be told apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench import per_step_ms  # noqa: E402
from step_idle import bench_model  # noqa: E402  (this script's folder is on sys.path)
from sustained_gemm import Meter, sustained  # noqa: E402

SAMPLE_S = 0.02
PEER_NAMES = {"120M": "120m", "12M": "12m"}


class Sampler:
    """(time, mJ, MHz) every SAMPLE_S seconds in a thread, from start() to stop()."""

    def __init__(self, meter: Meter):
        self.meter, self.samples, self._stop = meter, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.meter.energy_mj(), self.meter.sm_mhz()))
            time.sleep(SAMPLE_S)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()

    def window(self, t0: float, t1: float) -> tuple[float, int, int]:
        """Mean watts between t0 and t1, and the SM clock's median and minimum there."""
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if len(s) < 3:
            raise SystemExit(f"only {len(s)} energy samples in a {t1 - t0:.2f} s window: run more --steps")
        watts = (s[-1][1] - s[0][1]) / 1e3 / (s[-1][0] - s[0][0])
        clocks = sorted(x[2] for x in s)
        return watts, clocks[len(clocks) // 2], clocks[0]


def report(who: str, ms: float, window: tuple[float, int, int]) -> None:
    watts, mhz, low = window
    print(f"{who}: {ms:.3f} ms a step, {watts:.0f} W, {watts * ms:,.0f} mJ a step; SM clock median {mhz} MHz "
          f"(min {low})", flush=True)


def op_energy(precision: str, shape: str, meter: Meter, window: float) -> None:
    """Each op of a step metered alone under sustained load (--ops)."""
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.model import Model, init_params
    from andrea.timing import OpRecorder
    from bench import BENCH, EXPERIMENTS, OPTIMIZER, lr_at, options, synthetic_micro_batches

    engine = CudaEngine(precision=precision)
    recorder = OpRecorder(engine)
    model = Model(recorder, EXPERIMENTS[shape].model, BENCH[shape], graphs=False, **options(shape))
    model.load_state(init_params(model.layout, 0))
    recorder.calls.clear()  # the load's own launches (the weights' cast) are not a step's
    model.train_step(synthetic_micro_batches(model.shape, model.micro_batch, 1, 0), step=0, lr=lr_at(0),
                     optimizer=OPTIMIZER)
    counts, rows = recorder.per_step(), []
    for op, (args, kwargs) in recorder.first_calls().items():
        ms, mj, mhz = sustained(engine, meter, lambda: getattr(engine, op)(*args, **kwargs), 0.3, window)
        rows.append((mj * counts[op], op, counts[op], ms, mj, mhz))
    total = sum(r[0] for r in rows)
    print(f"ANDREA {shape} {precision}, each op alone under sustained load ({window:g} s each):", flush=True)
    for step_mj, op, n, ms, mj, mhz in sorted(rows, reverse=True):
        print(f"  {op:24s} x{n:<3d} {ms:8.4f} ms {mj / ms:5.0f} W {mj:8.2f} mJ a call {step_mj:8.1f} mJ a step "
              f"({step_mj / total:4.0%}), SM {mhz} MHz", flush=True)
    print(f"  sum {total:,.0f} mJ a step", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", default="120M", choices=sorted(PEER_NAMES), help="the benchmark's shape (default 120M)")
    ap.add_argument("--precisions", default="bf16,fp8", help="the engine's, comma-separated (default bf16,fp8)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps of each (default 200)")
    ap.add_argument("--baseline", default=os.environ.get("ANDREA_PEER_BASELINE", "none"),
                    help="the PyTorch peer script (default $ANDREA_PEER_BASELINE; none: the engine alone)")
    ap.add_argument("--ops", action="store_true", help="then meter the first precision's ops one by one")
    ap.add_argument("--op-window", type=float, default=1.0, help="seconds each op is metered (default 1.0)")
    args = ap.parse_args()
    import cupy

    meter = Meter()
    sampler = Sampler(meter)
    sampler.start()
    for precision in args.precisions.split(","):
        engine, model = bench_model(args.shape, precision)
        per_step_ms(model, steps=20, warm=0)
        t0 = time.perf_counter()
        ms = per_step_ms(model, steps=args.steps, warm=0)
        report(f"ANDREA {args.shape} {precision}", ms, sampler.window(t0, time.perf_counter()))
        del model, engine
        cupy.get_default_memory_pool().free_all_blocks()
        time.sleep(2)  # the next one starts from a card at rest
    if args.baseline != "none":
        peer = subprocess.Popen([sys.executable, args.baseline, PEER_NAMES[args.shape], "bf16-compile",
                                 str(args.steps)], stdout=subprocess.PIPE, text=True)
        result, t_end = None, 0.0
        for line in peer.stdout:
            if line.startswith("{"):  # printed right after its timed steps
                t_end, result = time.perf_counter(), json.loads(line)
        if peer.wait() != 0 or result is None:
            raise SystemExit(f"the peer {args.baseline} failed (exit {peer.returncode})")
        ms = result["ms_per_step"]
        # its timed steps end where the line came; they began about steps x the median before
        report(f"PyTorch {args.shape} bf16 + compile", ms,
               sampler.window(t_end - args.steps * ms / 1e3 + 0.1, t_end - 0.05))
    sampler.stop()
    if args.ops:
        op_energy(args.precisions.split(",")[0], args.shape, meter, args.op_window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
