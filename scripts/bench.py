"""The benchmark: tokens/s of the CUDA engine's training step against the PyTorch peer, in one call.

    PYTHONPATH=. python3 scripts/bench.py [--out DIR] [--baseline PATH (default bench/peer_pytorch.py)]
        [--sections device,ceilings,memory,bench] [--bench fp32,tf32,bf16,fp16,fp8,bf16-eager] [--peers ...]
        [--rounds 1] [--peer-runs 3] [--shapes 12M,120M,350M]

Correctness (every op against float64 NumPy, training, determinism, memory, resume) is the `gpu` tests:
`python3 -m pytest -m gpu`. This script only measures:
  device    the GPU, its driver and runtime versions
  ceilings  cuBLAS rate (8192^3) per precision and device-to-device copy bandwidth, measured here
  memory    the trainer's memory plan (training model, the sampler inside it) against CuPy's pool and the device
  bench     train_step at 12M (B=32, T=512) and 120M (B=8, T=1024), with --shapes also 350M (B=8, T=1024,
            GPT-2 medium), per precision; each op of the real step
            (recorded by andrea.schedule.timing.OpRecorder) timed in a CUDA graph, with its FLOPs and bytes
            (andrea/ops); with --rounds N the variants of a shape take turns N times, their medians counting;
            the PyTorch peer's variants in the same call, each in --peer-runs processes, the fastest counting;
            a -mma variant (bf16-mma, fp8-mma) is the engine without Hopper's warpgroup kernels, as sm_80/sm_89
            cards run it
A precision's bar is its ratio to the faster compiled peer that ran (andrea.schedule.timing.BAR_PEERS): for bf16
bf16-compile, for fp8 the faster of bf16-compile and fp8-compile (torchao float8); the table marks it "(the bar)".
The peer is bench/peer_pytorch.py, or the script given by --baseline or $ANDREA_PEER_BASELINE; with 'none'
the bench section times the engine alone and says so. Writes bench.json and bench.txt under --out (default: $OUT, else results/bench); scripts/gpu_report.py
turns bench.json into docs/PERFORMANCE.md's tables. Exits non-zero if any section fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from andrea.spec.config import load_experiment  # noqa: E402
from andrea.schedule.crosscheck import (OPTIMIZER, free_device_memory, loss_masks, lr_at,  # noqa: E402
                                        synthetic_micro_batches)
from andrea.ops import op_cost  # noqa: E402
from andrea.spec.precision import PRECISIONS  # noqa: E402
from andrea.run.train import model_options  # noqa: E402
from andrea.schedule.timing import (OpRecorder, against_bf16, alternating, fastest_peer, graph_ms, median_ms,  # noqa: E402
                                     peer_pairs, variant_parts)

EXPERIMENTS = {n: load_experiment(REPO / "config" / "experiments" / f"ANDREA-{n}-TRAIN.json") for n in ("12M", "120M", "350M")}
BENCH = {"12M": 32, "120M": 8, "350M": 8}  # micro-batch of the benchmark (the PyTorch baseline's B)
DEFAULT_SHAPES = ("12M", "120M")  # what --shapes measures unless told
# bf16-eager: the step launched op by op instead of as a CUDA graph; -masked: every step under a loss mask (a draw of
# 0s and 1s, as a polish phase's assistant-only loss: crosscheck.loss_masks), the weighted backward; -mma: the
# engine without Hopper's warpgroup kernels (ANDREA_WGMMA=0), the build every sm_80+ card runs
BENCH_VARIANTS = (*PRECISIONS, "bf16-eager", "bf16-masked", "fp8-masked", "bf16-mma", "fp8-mma")


def engine_for(variant: str):
    """The CUDA engine a benchmark variant runs on: its precision, and for -mma no warpgroup kernels."""
    from andrea.engines.cuda_engine import CudaEngine

    v = variant_parts(variant)
    return CudaEngine(precision=v.precision, hopper_kernels=False if v.mma else None)


PEER_VARIANTS = ("fp32", "tf32", "bf16", "bf16-compile")
ROUNDS = "median of {n} rounds"  # how an engine variant's --rounds count
BASELINE_SHAPE = {"12M": "12m", "120M": "120m", "350M": "350m"}
# The PyTorch peer: the same model in plain PyTorch, at the same shapes and micro-batches (tests/test_peer_pytorch.py)
PEER = REPO / "bench" / "peer_pytorch.py"

report: dict = {}
failed: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def section(name):
    def wrap(fn):
        def run(*args):
            log(f"\n== {name} ==")
            t0 = time.time()
            try:
                report[name] = fn(*args)
            except Exception:
                failed.append(name)
                report[name] = {"error": traceback.format_exc()}
                log(report[name]["error"])
            report[name]["seconds"] = round(time.time() - t0, 1)
        return run
    return wrap


def options(name: str) -> dict:
    """The memory options the trainer gives the experiment's model on the CUDA engine, in every precision."""
    return model_options(EXPERIMENTS[name], "cuda")


def host_cpu() -> dict:
    """The host's CPU: a peer whose step launches its kernels from Python one by one (PyTorch + torch.compile at 12M)
    is timed on it as much as on the GPU, so a ratio against it holds for this host only."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        model = names[0] if names else model
    return {"cpu": model, "cpus": os.cpu_count()}


@section("device")
def device_info():
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    info = {"name": props["name"].decode(), "sms": props["multiProcessorCount"],
            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "compute_capability": cupy.cuda.Device(0).compute_capability,
            "driver": cupy.cuda.runtime.driverGetVersion(), "runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cupy": cupy.__version__, "numpy": np.__version__, **host_cpu()}
    log(json.dumps(info))
    return info


@section("ceilings")
def ceilings():
    import cupy

    from andrea.engines.cuda_engine import CudaEngine

    n = 8192
    a = cupy.random.standard_normal((n, n), dtype=np.float32)
    b = cupy.random.standard_normal((n, n), dtype=np.float32)
    c = cupy.empty((n, n), dtype=np.float32)
    out = {}
    for name, p in PRECISIONS.items():
        blas = CudaEngine(precision=name).blas
        x, y, z = (a, b, c) if not p.low else (cupy.asarray(cupy.asnumpy(m).astype(p.act_dtype)) for m in (a, b, c))
        ms = median_ms(lambda: blas.gemm(z, x, y, n, n, n), reps=5)
        out[f"{name}_tflops"] = round(2 * n**3 / ms / 1e9, 1)
    src = cupy.random.standard_normal(2**29 // 4 * 4, dtype=np.float32)  # 2 GiB
    dst = cupy.empty_like(src)
    ms = median_ms(lambda: dst.__setitem__(slice(None), src), reps=5)
    out["copy_tb_s"] = round(2 * src.nbytes / ms / 1e9, 2)
    a = b = c = src = dst = None  # device memory back before the next section
    free_device_memory()
    log(json.dumps(out))
    return out


@section("memory")
def memory(shapes):
    import cupy

    from andrea.engines.cuda_engine import CudaEngine
    from andrea.spec.memory import device_bytes
    from andrea.schedule.model import Model
    from andrea.tools.sample import Sampler

    pool = cupy.get_default_memory_pool()
    out = {}
    for name in shapes:
        for precision in ("fp32", "bf16", "fp8"):
            free_device_memory()
            before = pool.total_bytes()
            engine = CudaEngine(precision=precision)
            shape = EXPERIMENTS[name].model
            model = Model(engine, shape, BENCH[name], **options(name))
            # as the trainer runs it: inside the training model's memory
            sampler = Sampler(engine, shape, SimpleNamespace(vocab_size=shape.vocab_size, im_end_id=1, endoftext_id=0),
                              share=model)
            plan = device_bytes(model.plan, sampler.model.plan)
            entry = {"micro_batch": BENCH[name], "plan_bytes": plan, "training_plan_bytes": model.plan.total_bytes,
                     "sampler_plan_bytes": sampler.model.plan.total_bytes, "engine_own_bytes": engine.own_bytes,
                     "pool_bytes": pool.total_bytes() - before}
            out[f"{name}/{precision}"] = entry
            log(f"{name}/{precision} B={BENCH[name]}: plan {plan / 2**20:,.1f} MiB (the sampler's "
                f"{entry['sampler_plan_bytes'] / 2**20:,.1f} MiB inside it, the engine's own {engine.own_bytes / 2**20:.1f} MiB); "
                f"pool {entry['pool_bytes'] / 2**20:,.1f} MiB")
            del model, sampler, engine
    free_device_memory()
    return out


def per_step_ms(model, steps: int = 13, warm: int = 3, masked: bool = False) -> float:
    batches = [synthetic_micro_batches(model.shape, model.micro_batch, 1, s) for s in range(4)]
    masks = [loss_masks(b, s) if masked else None for s, b in enumerate(batches)]
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        model.train_step(batches[step % 4], step=step, lr=lr_at(step), optimizer=OPTIMIZER, weights=masks[step % 4])
        model.engine.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warm:]) * 1e3


def op_times(engine, recorder, model, names=None) -> dict:
    """Each op of one real step (or those in `names`), timed alone inside a CUDA graph on the step's own buffers,
    with its FLOPs and bytes: the model built on `recorder`, an OpRecorder of `engine`."""
    shape, micro = model.shape, model.micro_batch
    # the ops of one real step, launched one by one (a graph replay calls no engine method)
    recorder.calls.clear()
    graphs, model.graphs = model.graphs, False
    model.train_step(synthetic_micro_batches(shape, micro, 1, 0), step=0, lr=lr_at(0), optimizer=OPTIMIZER)
    model.graphs = graphs
    counts = recorder.per_step()
    ops_ms = {}
    act_bytes = np.dtype(PRECISIONS[engine.precision].act_dtype).itemsize
    firsts = recorder.first_calls()
    for op, (args, kwargs) in firsts.items():
        if names is not None and op not in names:
            continue
        rows = micro
        if op.startswith("loss"):
            rows = args[0].shape[0] if op == "loss_bwd" else args[1].shape[0]  # one classifier piece
        flops, nbytes = op_cost(op, shape, rows, model.layout.n_params, act_bytes)
        t = graph_ms(engine, lambda: getattr(engine, op)(*args, **kwargs))
        if op == "loss_bwd" and engine.fp8:  # its FP8 products read the E5M2 d_logits of the forward before it
            fwd_args, fwd_kwargs = firsts["loss_fwd"]
            forward = lambda: engine.loss_fwd(*fwd_args, **fwd_kwargs)  # noqa: E731
            t = graph_ms(engine, lambda: (forward(), engine.loss_bwd(*args, **kwargs))) - graph_ms(engine, forward)
        ops_ms[op] = {"ms": round(t, 4), "gflop": round(flops / 1e9, 3), "mbytes": round(nbytes / 1e6, 2),
                      "tflop_s": round(flops / t / 1e9, 1), "tb_s": round(nbytes / t / 1e9, 2),
                      "calls_per_step": counts[op]}
    return ops_ms


@section("bench")
def bench(baseline: str | None, variants, peers, shapes, peer_runs: int = 1, rounds: int = 1):
    """Each engine variant's step at both shapes (with `rounds` > 1 the shape's variants built together and timed in
    turn, round after round, their median counting: timing.alternating), each plain variant's ops, then the peers."""
    from andrea.spec.layout import ParameterLayout
    from andrea.schedule.model import Model, init_params

    out = {"engine": {}, "ops": {}, "baseline": {}, "host": host_cpu()}
    for name, micro in ((n, BENCH[n]) for n in shapes):
        shape = EXPERIMENTS[name].model
        tokens = micro * shape.seq_len
        init = init_params(ParameterLayout(shape), 0)  # every variant's weights: the layout is the shape's
        for group in ([variants] if rounds > 1 else [[v] for v in variants]):  # one at a time: less device memory
            built = {}
            for variant in group:
                v = variant_parts(variant)
                engine = engine_for(variant)
                recorder = OpRecorder(engine)
                model = Model(recorder, shape, micro, graphs=not v.eager, **options(name))
                built[variant] = (engine, recorder, model, v.masked)

            def timer(variant):
                _, _, model, masked = built[variant]

                def run():
                    model.load_state(init)  # every round the same steps from the same weights
                    return per_step_ms(model, masked=masked)
                return run

            times = alternating({v: timer(v) for v in group}, rounds)
            for variant, (engine, recorder, model, masked) in built.items():
                ms = statistics.median(times[variant])
                entry = {"micro_batch": micro, "ms_per_step": round(ms, 2), "tokens_per_s": round(tokens / ms * 1e3)}
                if rounds > 1:
                    entry["runs_ms"] = [round(t, 3) for t in times[variant]]
                out["engine"][f"{name}/{variant}"] = entry
                log(f"{name} {variant} B={micro}: {ms:.2f} ms/step, {tokens / ms * 1e3:,.0f} tokens/s"
                    + (f" (median of {rounds} rounds: " + ", ".join(f"{t:.2f}" for t in times[variant]) + ")"
                       if rounds > 1 else ""))
                if variant_parts(variant).plain:  # the op timings are the plain variant's
                    ops_ms = op_times(engine, recorder, model)
                    out["ops"][f"{name}/{variant}"] = ops_ms
                    log("  ops " + ", ".join(f"{op} {v['ms']:.3f}" for op, v in ops_ms.items()))
            built = engine = recorder = model = None  # this group's device memory back before the next
            free_device_memory()
    if baseline:
        for name in shapes:
            for variant in peers:
                runs = []
                for _ in range(peer_runs):
                    r = subprocess.run([sys.executable, baseline, BASELINE_SHAPE[name], variant, "20"],
                                       capture_output=True, text=True, timeout=500)
                    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
                    if r.returncode or not lines:
                        raise RuntimeError(f"baseline {name} {variant} failed ({r.returncode}): {r.stderr[-2000:]}")
                    runs.append(json.loads(lines[-1]))
                    log(f"baseline {name} {variant}: {lines[-1]}")
                out["baseline"][f"{name}/{variant}"] = fastest_peer(runs)
    return out


def spread(entry: dict, counted: str) -> str:
    """An entry's readings (`runs_ms`: the peer's processes, the engine's --rounds) beside the one that counts,
    where there were several; `counted` says which counts, e.g. "fastest of {n} runs"."""
    runs = entry.get("runs_ms", [])
    return f"  ({counted.format(n=len(runs))}: {min(runs):.2f}-{max(runs):.2f} ms)" if len(runs) > 1 else ""


def table() -> str:
    """One line an engine variant and PyTorch peer that ran in this call; a variant without one, one line."""
    lines, paired = [], {}
    for name, precision, e, peer, base, counts in peer_pairs(report.get("bench", {})):
        engine = f"{name:5} B={e['micro_batch']:<3} {precision:11} {e['ms_per_step']:8.2f} ms {e['tokens_per_s']:>11,} tok/s"
        paired.setdefault(engine, (False, e))
        if base:
            paired[engine] = (True, e)
            lines.append(f"{engine}   PyTorch {peer:13} {base['ms_per_step']:8.2f} ms {base['tokens_per_s']:>11,} tok/s  "
                         f"{e['tokens_per_s'] / base['tokens_per_s']:.2f}x{' (the bar)' if counts else ''}"
                         f"{spread(base, 'fastest of {n} runs')}{spread(e, ROUNDS)}")
    lines += [f"{engine}   (no PyTorch peer of this precision ran){spread(e, ROUNDS)}"
              for engine, (done, e) in paired.items() if not done]
    lines += [f"{name:5} {variant:11} {ratio:.3f}x ANDREA bf16 (tokens/s, this call)"
              for name, variant, ratio in against_bf16(report.get("bench", {}))]
    if any(done for done, _ in paired.values()):
        host = report["bench"].get("host", {})
        lines.append(f"host: {host.get('cpu', '?')}, {host.get('cpus', '?')} CPUs (the peer launches its kernels from it)")
    for key, e in report.get("memory", {}).items():
        if isinstance(e, dict) and "plan_bytes" in e:
            lines.append(f"memory {key}: plan {e['plan_bytes'] / 2**20:,.1f} MiB, pool {e['pool_bytes'] / 2**20:,.1f} MiB")
    lines.append("failed sections: " + (", ".join(failed) if failed else "none"))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "results/bench"))
    parser.add_argument("--baseline", default=os.environ.get("ANDREA_PEER_BASELINE", str(PEER)),
                        help=f"the PyTorch peer script (default: $ANDREA_PEER_BASELINE, else {PEER.relative_to(REPO)}; "
                             "'none': no peers)")
    parser.add_argument("--sections", default="device,ceilings,memory,bench")
    parser.add_argument("--bench", default=",".join((*PRECISIONS, "bf16-eager")),
                        help=f"engine variants the bench section times, of {', '.join(BENCH_VARIANTS)}")
    parser.add_argument("--peers", default=",".join(PEER_VARIANTS), help="PyTorch baseline variants it runs")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help=f"the experiments' shapes the memory and bench sections measure, of {', '.join(BENCH)}")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of the engine's variants, timed in turn within a round, their median counting "
                             "(more than 1: a shape's variants are in device memory together)")
    parser.add_argument("--peer-runs", type=int, default=3,
                        help="processes each peer variant runs in; the fastest counts (its step time moves between "
                             "processes: 12M bf16 + compile has read 6.7-11.4 ms)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: the engine's variants run at least one round")
    if args.peer_runs < 1:
        parser.error(f"--peer-runs {args.peer_runs}: the peers run in at least one process each")
    if unknown := set(args.shapes.split(",")) - set(BENCH):
        parser.error(f"--shapes: no benchmark shape {', '.join(sorted(unknown))}; choose from {', '.join(BENCH)}")
    shapes = args.shapes.split(",")
    baseline = None if args.baseline in (None, "", "none") else args.baseline
    if baseline and not Path(baseline).is_file():
        parser.error(f"--baseline {baseline}: no such file; give the PyTorch peer script, or 'none' for no peers")
    if baseline is None and "bench" in args.sections.split(","):
        log("no PyTorch peer: the bench section times the engine alone (--baseline PATH or ANDREA_PEER_BASELINE)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = {"device": device_info, "ceilings": ceilings, "memory": lambda: memory(shapes),
             "bench": lambda: bench(baseline, args.bench.split(","), args.peers.split(","), shapes, args.peer_runs,
                                   args.rounds)}
    for name in args.sections.split(","):
        if name not in steps:
            parser.error(f"unknown section {name!r}; choose from {', '.join(steps)}")
        steps[name]()
        (out / "bench.json").write_text(json.dumps(report, indent=1, default=str))
    text = table()
    (out / "bench.txt").write_text(text + "\n")
    log("\n" + text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
