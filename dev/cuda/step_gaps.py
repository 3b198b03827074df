"""Where a recorded step's device time goes between kernels: each kernel's start and end inside one replay of
the micro-batch graph and the optimizer, read by CUPTI (through PyTorch's profiler, which records every kernel of
the process, CuPy's and cuBLAS's too), then the span, the time some kernel ran, and the gaps between them.

    PYTHONPATH=. python3 dev/cuda/step_gaps.py [--runs 120M/bf16,12M/bf16,120M/fp8] [--out DIR]

One line a run (the step's time and its weights' digest after 8 steps; kernels and the graph's memset nodes, the
span from the first to the last, the time some kernel ran, the gaps), the transitions that lose the most, a
memset node named as itself, and the kernels that take the most device time. The whole timeline goes to DIR/step_gaps.json. Exits 1 when the profiler saw no
kernel (nothing to judge).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import cupy  # noqa: E402

from bench import per_step_ms  # noqa: E402
from step_idle import bench_model, optimizer_launches  # noqa: E402  (this script's folder is on sys.path)


def short(name: str) -> str:
    """A kernel's family: ours by name, cuBLAS's by its library prefix."""
    name = name.split("(")[0]
    for lib in ("cutlass", "sm90_xmma", "sm80_xmma", "nvjet", "gemm", "gemv", "cublas"):
        if lib in name.lower():
            return f"blas:{name[:40]}"
    return name[:48]


def timeline(fn) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel and memset or copy node fn() runs on the device, in start order."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    cupy.cuda.get_current_stream().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        cupy.cuda.get_current_stream().synchronize()
        torch.cuda.synchronize()
    out = []
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.name:  # kernels, and the graph's memset and copy nodes
            start = ev.time_range.start
            out.append((ev.name, float(start), float(start + ev.time_range.elapsed_us())))
    out.sort(key=lambda k: k[1])
    return out


def analyse(kernels) -> dict:
    """Kernels and memset nodes counted apart, span, busy time (some kernel running), gaps (none running) and the
    transitions that lose the most."""
    span = kernels[-1][2] - kernels[0][1]
    busy, end, last = 0.0, kernels[0][1], kernels[0][0]
    gaps = defaultdict(lambda: [0, 0.0])
    hist = defaultdict(int)
    for name, start, stop in kernels:
        if start > end:
            gap = start - end
            key = f"{short(last)} -> {short(name)}"
            gaps[key][0] += 1
            gaps[key][1] += gap
            hist["<1us" if gap < 1 else "1-2us" if gap < 2 else "2-4us" if gap < 4 else ">=4us"] += 1
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, name
    top = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:15]
    memsets = sum(1 for k in kernels if k[0].startswith(("Memset", "memset")))
    spent = defaultdict(lambda: [0, 0.0])  # each kernel's calls and device time, summed over the step
    for name, start, stop in kernels:
        kernel = spent[name.split("(")[0]]
        kernel[0] += 1
        kernel[1] += stop - start
    return {"kernels": len(kernels) - memsets, "memsets": memsets, "span_ms": span / 1e3, "busy_ms": busy / 1e3,
            "gap_ms": (span - busy) / 1e3,
            "histogram": dict(hist), "top": [(k, n, round(t, 1)) for k, (n, t) in top],
            "busiest": [(k[:72], n, round(t, 1)) for k, (n, t) in sorted(spent.items(), key=lambda kv: -kv[1][1])[:20]],
            "blas_kernels": sum(1 for k in kernels if short(k[0]).startswith("blas:"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="120M/bf16,12M/bf16,120M/fp8", help="shape/precision, comma-separated")
    ap.add_argument("--out", default=os.environ.get("OUT", "results/step_gaps"))
    args = ap.parse_args()
    report, seen_any = {}, False
    for run in args.runs.split(","):
        name, precision = run.split("/")
        engine, model = bench_model(name, precision)
        step = per_step_ms(model, steps=8, warm=3)
        # the weights after 8 steps, hashed as kernels_ab.py hashes them
        digest = hashlib.sha256(model.host_state()[0].tobytes()).hexdigest()[:16]
        (graph,) = model.step_graphs
        optimizer = optimizer_launches(engine, model)
        kernels = timeline(lambda: (engine.replay(graph), optimizer()))
        if not kernels:
            print(f"{run}: the profiler saw no kernel", flush=True)
            continue
        seen_any = True
        a = analyse(kernels)
        a["step_ms"], a["params_sha256"] = step, digest
        report[run] = {**a, "timeline": kernels}
        print(f"{run}: step {step:.3f} ms, weights {digest}; {a['kernels']} kernels "
              f"({a['blas_kernels']} cuBLAS) and {a['memsets']} memsets, span {a['span_ms']:.3f} "
              f"ms, busy {a['busy_ms']:.3f}, gaps {a['gap_ms']:.3f} ({a['gap_ms'] / a['span_ms']:.1%}); "
              f"gaps {a['histogram']}", flush=True)
        for key, n, us in a["top"]:
            print(f"    {us:8.1f} us  {n:4d}x  {key}")
        print("  the busiest kernels (device time summed over the step):")
        for key, n, us in a["busiest"]:
            print(f"    {us:8.1f} us  {n:4d}x  {key}")
        del model, engine
        cupy.get_default_memory_pool().free_all_blocks()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "step_gaps.json").write_text(json.dumps(report))
    return 0 if seen_any else 1


if __name__ == "__main__":
    sys.exit(main())
