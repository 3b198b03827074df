"""The step's products under sustained load: each cuBLASLt algorithm's time and energy once the card has settled
at its power cap, against the algorithm table's choice, which scripts/tune_gemm.py makes from short timings.

    PYTHONPATH=. python3 dev/cuda/sustained_gemm.py [--shape 120M] [--precision bf16] [--settle 0.4] [--window 0.4]
        [--out FILE]

A training step runs its products back to back and holds the card at its power cap, where the SM clock drops
(docs/PERFORMANCE.md); scripts/tune_gemm.py times each algorithm in graphs of ten calls, about a millisecond, at the
boost clock. Here each algorithm of each product of one eager step (scripts/tune_gemm.py's step_products) is
replayed for --settle seconds, so that the power controller settles, then for --window seconds more, timed by
CUDA events and metered by NVML's energy counter: ms and mJ a call and the SM clock at the window's end. A
plain product's baseline (cublasGemmEx) is measured the same way. It prints, per product, the table's choice and
the sustained fastest, and with --out writes a table of the sustained choices (same margin and format as
scripts/tune_gemm.py's) to FILE, for dev/cuda/kernels_ab.py to run the step on. It reports; it changes no file
of the engine. NVML's counter moves in steps of a few milliseconds, so mJ a call is good to a few per cent.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import cupy  # noqa: E402

from andrea.engines.cublas import ALGORITHMS_FILE, algorithm_table, merged_tables  # noqa: E402
from andrea.timing import graph_ms  # noqa: E402
from bench import BENCH  # noqa: E402
from tune_gemm import planned, step_products  # noqa: E402

GRAPH_MS = 2.0  # calls a graph holds: about this long a replay, so the host keeps the card fed


class Meter:
    """NVML's total energy counter (mJ) and SM clock (MHz) of GPU 0, through ctypes."""

    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise SystemExit("NVML did not start: this script needs the NVIDIA driver's libnvidia-ml")
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)) != 0:
            raise SystemExit("NVML found no GPU 0")

    def energy_mj(self) -> int:
        mj = ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(mj)) != 0:
            raise SystemExit("NVML gives no energy counter on this GPU")
        return mj.value

    def sm_mhz(self) -> int:
        mhz = ctypes.c_uint()
        self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(mhz))  # NVML_CLOCK_SM
        return mhz.value


def sustained(engine, meter: Meter, fn, settle: float, window: float) -> tuple[float, float, int]:
    """(ms, mJ) a call of fn and the SM clock, fn replayed from a graph for `settle` s, then timed over `window` s."""
    fn()  # eagerly first: what a call sets up (a cuBLASLt plan) is made outside the capture
    engine.synchronize()
    inner = max(10, int(GRAPH_MS / graph_ms(engine, fn, reps=1)))
    graph = engine.capture(lambda: [fn() for _ in range(inner)])
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def replay_for(seconds: float) -> int:
        n, stop = 0, time.perf_counter() + seconds
        while time.perf_counter() < stop:
            for _ in range(4):  # a few graphs queued ahead of the host's clock check
                engine.replay(graph)
            n += 4
            if n % 64 == 0:  # the host no further ahead than that
                engine.synchronize()
        return n

    replay_for(settle)
    engine.synchronize()
    e0 = meter.energy_mj()
    start.record()
    n = replay_for(window)
    end.record()
    end.synchronize()
    e1, mhz = meter.energy_mj(), meter.sm_mhz()
    calls = n * inner
    return cupy.cuda.get_elapsed_time(start, end) / calls, (e1 - e0) / calls, mhz


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", default="120M", choices=sorted(BENCH), help="the benchmark's shape (default 120M)")
    ap.add_argument("--precision", default="bf16", help="(default bf16)")
    ap.add_argument("--settle", type=float, default=0.4, help="seconds of replays before timing (default 0.4)")
    ap.add_argument("--window", type=float, default=0.4, help="seconds timed (default 0.4)")
    ap.add_argument("--margin", type=float, default=0.03, help="as scripts/tune_gemm.py's (default 0.03)")
    ap.add_argument("--out", type=Path, help="write a table of the sustained choices here (a copy of the engine's "
                                             "table with this GPU's entries for these products replaced)")
    args = ap.parse_args()
    meter = Meter()
    engine, model, calls = step_products(args.shape, args.precision)
    lt = engine.blas_lt
    tables = json.loads(ALGORITHMS_FILE.read_text())["tables"]
    table = algorithm_table(tables, lt.device, lt.version)
    choices, measured, baselines = {}, {}, {}
    moved = 0
    for pname, (kind, args_, kwargs) in calls.items():
        if kwargs.get("epilogue") == "gelu":
            continue  # runs on its gelu_aux partner's algorithm (scripts/tune_gemm.py)
        n_algo = lt.algorithms(*args_, **planned(kwargs))
        rows = {}
        if kind == "plain":
            rows[None] = sustained(engine, meter, lambda: engine.blas.gemm_ex(*args_, **kwargs), args.settle,
                                   args.window)
        for i in range(n_algo):
            rows[i] = sustained(engine, meter, lambda i=i: lt.gemm(*args_, **{**kwargs, "algo": i}), args.settle,
                                args.window)
        base = rows[None if kind == "plain" else 0][0]
        best = min((i for i in rows if i is not None), key=lambda i: rows[i][0], default=None)
        pick = best if best is not None and rows[best][0] < (1 - args.margin) * base else None
        now = table.get(pname)
        measured[pname] = [round(rows[i][0], 4) for i in range(n_algo)]
        if kind == "plain":
            baselines[pname] = round(base, 4)
        if pick is not None:
            choices[pname] = pick
        moved += pick != now
        cells = " ".join(f"{'gemmEx' if i is None else i}:{ms:.4f}ms/{mj:.2f}mJ/{mhz}" for i, (ms, mj, mhz) in
                         rows.items())
        print(f"{kind} {pname}: table {now if now is not None else '-'}, sustained {pick if pick is not None else '-'}"
              f"{'  MOVED' if pick != now else ''}\n    {cells}", flush=True)
    print(f"{args.shape}/{args.precision}: {moved} of {len(measured)} products choose otherwise under sustained load",
          flush=True)
    if args.out is not None:
        tables = merged_tables(tables, lt.device, lt.version, args.margin, choices, measured, baselines)
        args.out.write_text(json.dumps({"tables": tables}, indent=1) + "\n")
        print(f"{args.out}: the sustained choices of {len(measured)} products on {lt.device}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
