"""The GPU check: one command on a CUDA machine that builds, checks and times the CUDA engine.

    PYTHONPATH=. python3 scripts/gpu_check.py [--out DIR] [--baseline .device/bench/torch_baseline.py]

Sections, each reported even when another fails:
  device       the GPU, its driver and runtime versions
  build        NVRTC compile of every kernel file for this device's architecture
  ceilings     fp32 / tf32 cuBLAS rate (8192^3) and device-to-device copy bandwidth, measured here
  ops          every op pair (forward and backward) against the float64 NumPy reference, on fresh
               random inputs at the tiny, 12M and 120M shapes, for the fp32, tf32 and bf16 engines
  train        20 optimizer steps, NumPy fp32 against CUDA fp32, tf32 and bf16 from the same init
  parity       200 steps of the 12M model in bf16 against fp32 from the same init (final loss within 1%)
  determinism  the same run twice on the CUDA engine: identical params, m and v bytes
  memory       memory plan bytes (the engine's own buffers included) against CuPy's pool and the
               device's used memory; pool requests during a train step (must be 0); the PyTorch
               baseline's peak beside them
  resume       `andrea train --engine cuda` stopped by SIGTERM and resumed equals an unbroken run (fp32, bf16)
  cross        a checkpoint written by `andrea train --engine cuda` resumes on `--engine numpy`, and
               the other way round; both trajectories match the all-NumPy run
  bench        train_step tokens/s at the 12M (B=32, T=512) and 120M (B=8, T=1024) shapes, fp32, tf32
               and bf16, per-op times, and the PyTorch baseline's variants run in the same call
Prints a table last; writes gpu_check.json and gpu_check.txt under --out (default: $OUT if set,
else results/gpu_check).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from andrea.config import ModelShape  # noqa: E402
from andrea.ops import op_cost  # noqa: E402
from andrea.precision import PRECISIONS  # noqa: E402
from andrea.engines.crosscheck import (  # noqa: E402
    OPS, OpShape, compare_op, lr_at, OPTIMIZER, step_allocations, synthetic_micro_batches, train_run,
)

EXPERIMENTS = REPO / "config" / "experiments"
SHAPES = {name: ModelShape(**json.loads((EXPERIMENTS / f"ANDREA-{name}-TRAIN.json").read_text())["model"])
          for name in ("tiny", "12M", "120M")}
# NumPy reference micro-batches for the op checks: 120M at B=1 keeps the float64 reference (a
# [1024, 768] x [768, 50304] product and its two backward products) to seconds on the host.
OP_BATCH = {"tiny": 4, "12M": 4, "120M": 1}
LOW = tuple(name for name, p in PRECISIONS.items() if p.low)  # 16-bit activations: these run the experiment's memory options
LIMITS = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 2e-2, "fp16": 1e-2}  # relative error ||got - ref|| / ||ref|| against float64
TRAIN = {"tiny": (4, 2), "12M": (2, 2)}  # (micro-batch, micro-batches) for the 20-step comparison
TRAIN_STEPS = 20
TRAIN_LIMITS = {"fp32": 1e-3, "tf32": 2e-2, "bf16": 3e-2, "fp16": 2e-2}  # max |loss - numpy loss| / numpy loss over the steps
BENCH = {"12M": 32, "120M": 8}  # micro-batch of the benchmark (the PyTorch baseline's B)
# Each experiment's memory options (its "recompute" and batch.loss_chunks): the 16-bit runs use them.
EXPERIMENT_RAW = {name: json.loads((EXPERIMENTS / f"ANDREA-{name}-TRAIN.json").read_text()) for name in ("tiny", "12M", "120M")}


def options(shape_name: str, precision: str) -> dict:
    """Model / train_run keyword arguments of the experiment's memory options, for a 16-bit precision."""
    if precision not in LOW:
        return {}
    raw = EXPERIMENT_RAW[shape_name]
    return {"recompute": tuple(raw.get("recompute", ())), "loss_chunks": raw["batch"].get("loss_chunks", 1)}
PARITY_STEPS, PARITY_LIMIT = 200, 0.01
BASELINE_SHAPE = {"12M": "12m", "120M": "120m"}
RESUME_ENGINE = "cuda"
CROSS_STEPS = 10
CROSS_LIMIT = 1e-4  # max |loss - numpy loss| / numpy loss, fp32

report: dict = {}
CHECKED = ("ops", "train", "parity", "determinism", "memory", "resume", "cross")  # sections with a verdict


def log(msg: str) -> None:
    print(msg, flush=True)


def section(name):
    def wrap(fn):
        def run(*args):
            log(f"\n== {name} ==")
            t0 = time.time()
            try:
                report[name] = fn(*args) or {}
            except Exception:
                report[name] = {"error": traceback.format_exc()}
                log(report[name]["error"])
            report[name]["seconds"] = round(time.time() - t0, 1)
        return run
    return wrap


def free_device_memory():
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()


def device_used() -> int:
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


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


# ---- sections --------------------------------------------------------------------------------
@section("device")
def device_info():
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    info = {"name": props["name"].decode(), "sms": props["multiProcessorCount"],
            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "compute_capability": cupy.cuda.Device(0).compute_capability,
            "driver": cupy.cuda.runtime.driverGetVersion(), "runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cupy": cupy.__version__, "numpy": np.__version__, "cpus": os.cpu_count()}
    log(json.dumps(info))
    return info


@section("build")
def build():
    import cupy

    from andrea.engines.cuda_engine import CudaEngine
    from andrea.kernels_build import compile_kernels

    arch = f"sm_{cupy.cuda.Device(0).compute_capability}"
    t0 = time.time()
    compiled = {p: compile_kernels(arch, precision=p) for p in ("fp32", "bf16", "fp16")}
    nvrtc_s = time.time() - t0
    t0 = time.time()
    for p in PRECISIONS:
        CudaEngine(precision=p)
    engine_s = time.time() - t0
    out = {"arch": arch, "nvrtc_seconds": round(nvrtc_s, 2), "engine_load_seconds": round(engine_s, 2),
           "cubin_bytes": {p: {op: len(c.cubin) for op, c in cs.items()} for p, cs in compiled.items()}}
    log(json.dumps(out))
    return out


@section("ceilings")
def ceilings():
    import cupy

    from andrea.engines.cuda_engine import CudaEngine

    n = 8192
    a = cupy.random.standard_normal((n, n), dtype=np.float32)
    b = cupy.random.standard_normal((n, n), dtype=np.float32)
    c = cupy.empty((n, n), dtype=np.float32)
    out = {}
    for precision in PRECISIONS:
        blas = CudaEngine(precision=precision).blas
        low = {"bf16": "bfloat16", "fp16": "float16"}.get(precision)
        x, y, z = (a, b, c) if low is None else (cupy.asarray(cupy.asnumpy(m).astype(low)) for m in (a, b, c))
        ms = median_ms(lambda: blas.gemm(z, x, y, n, n, n), reps=5)
        out[f"{precision}_tflops"] = round(2 * n**3 / ms / 1e9, 1)
    src = cupy.random.standard_normal(2**29 // 4 * 4, dtype=np.float32)  # 2 GiB
    dst = cupy.empty_like(src)
    ms = median_ms(lambda: dst.__setitem__(slice(None), src), reps=5)
    out["copy_tb_s"] = round(2 * src.nbytes / ms / 1e9, 2)
    del a, b, c, src, dst
    free_device_memory()
    log(json.dumps(out))
    return out


@section("ops")
def ops():
    from andrea.engines.cuda_engine import CudaEngine

    engines = {p: CudaEngine(precision=p) for p in PRECISIONS}
    rows = []
    for shape_name, shape in SHAPES.items():
        s = OpShape.of(shape, B=OP_BATCH[shape_name])
        for op in OPS:
            seed = int(np.random.SeedSequence().entropy % 2**63)
            t0 = time.time()
            result = compare_op(engines, op, s, np.random.default_rng(seed))
            for precision, outputs in result.items():
                worst = max(outputs.items(), key=lambda kv: kv[1]["rel"])
                rows.append({"shape": shape_name, "B": s.B, "T": s.T, "op": op, "precision": precision,
                             "worst_output": worst[0], "rel": worst[1]["rel"],
                             "max_abs": max(e["max_abs"] for e in outputs.values()),
                             "ok": all(e["rel"] <= LIMITS[precision] for e in outputs.values()),
                             "seed": seed, "outputs": outputs})
            log(f"{shape_name:5} {op:13} " + "  ".join(
                f"{r['precision']} rel {r['rel']:.1e} ({r['worst_output']}) abs {r['max_abs']:.1e}{'' if r['ok'] else ' FAIL'}"
                for r in rows[-len(engines):]) + f"  [{time.time() - t0:.1f}s]")
            free_device_memory()
    return {"rows": rows, "ok": all(r["ok"] for r in rows)}


@section("train")
def train():
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.engines.numpy_engine import NumpyEngine

    out = {}
    for shape_name, (micro, n_micro) in TRAIN.items():
        shape = SHAPES[shape_name]
        t0 = time.time()
        ref = train_run(NumpyEngine(), shape, micro, n_micro, TRAIN_STEPS)
        numpy_s = time.time() - t0
        entry = {"micro_batch": micro, "micro_batches": n_micro, "numpy_losses": ref.losses,
                 "numpy_seconds": round(numpy_s, 1)}
        for precision in PRECISIONS:
            run = train_run(CudaEngine(precision=precision), shape, micro, n_micro, TRAIN_STEPS,
                            **options(shape_name, precision))
            rel = [abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses)]
            params_rel = float(np.linalg.norm(run.params.astype(np.float64) - ref.params) / np.linalg.norm(ref.params))
            entry[precision] = {"losses": run.losses, "max_rel_loss_diff": max(rel), "final_params_rel": params_rel,
                                "ok": max(rel) <= TRAIN_LIMITS[precision]}
            free_device_memory()
            log(f"{shape_name} {precision}: loss {ref.losses[0]:.4f} -> {ref.losses[-1]:.4f} (numpy) vs "
                f"{run.losses[0]:.4f} -> {run.losses[-1]:.4f}; max rel diff {max(rel):.1e}; "
                f"final params rel {params_rel:.1e}")
        out[shape_name] = entry
    out["ok"] = all(out[s][p]["ok"] for s in TRAIN for p in PRECISIONS)
    return out


@section("parity")
def parity():
    """bf16 against fp32 over PARITY_STEPS steps of the 12M model at the benchmark's batch, same init and batches."""
    from andrea.engines.cuda_engine import CudaEngine

    shape, micro = SHAPES["12M"], BENCH["12M"]
    runs = {}
    for precision in ("fp32", "bf16"):
        t0 = time.time()
        runs[precision] = train_run(CudaEngine(precision=precision), shape, micro, 1, PARITY_STEPS,
                                    **options("12M", precision))
        free_device_memory()
        log(f"12M {precision}: {PARITY_STEPS} steps, loss {runs[precision].losses[0]:.4f} -> "
            f"{runs[precision].losses[-1]:.4f} [{time.time() - t0:.1f}s]")
    f, b = runs["fp32"].losses, runs["bf16"].losses
    final_rel = abs(b[-1] - f[-1]) / f[-1]
    last10_rel = abs(np.mean(b[-10:]) - np.mean(f[-10:])) / np.mean(f[-10:])
    out = {"steps": PARITY_STEPS, "micro_batch": micro, "fp32_losses": f, "bf16_losses": b,
           "final_rel": final_rel, "last10_rel": float(last10_rel), "ok": final_rel <= PARITY_LIMIT}
    log(f"final loss fp32 {f[-1]:.4f}, bf16 {b[-1]:.4f}: rel diff {final_rel:.2e} (last 10 steps' mean {last10_rel:.2e})")
    return out


@section("determinism")
def determinism():
    from andrea.engines.cuda_engine import CudaEngine

    out = {}
    for shape_name, micro, steps in (("12M", 8, 10), ("120M", 2, 3)):
        for precision in PRECISIONS:
            digests = [train_run(CudaEngine(precision=precision), SHAPES[shape_name], micro, 2, steps,
                                 **options(shape_name, precision)).digest for _ in range(2)]
            free_device_memory()
            out[f"{shape_name}/{precision}"] = {"steps": steps, "micro_batch": micro, "same_bits": digests[0] == digests[1],
                                                "sha256": digests}
            log(f"{shape_name} {precision}: {steps} steps twice -> {'identical' if digests[0] == digests[1] else 'DIFFERENT'} "
                f"({digests[0][:16]} / {digests[1][:16]})")
    out["ok"] = all(v["same_bits"] for v in out.values())
    return out


@section("memory")
def memory():
    import cupy

    from andrea.engines.cuda_engine import CudaEngine
    from andrea.model import Model, init_params

    pool = cupy.get_default_memory_pool()
    out = {}
    for key in (f"{s}/{p}" for p in ("fp32", "bf16") for s in BENCH):
        shape_name, precision = key.split("/")
        micro = BENCH[shape_name]
        free_device_memory()
        dev0, pool0 = device_used(), pool.total_bytes()
        engine = CudaEngine(precision=precision)
        model = Model(engine, SHAPES[shape_name], micro, **options(shape_name, precision))
        model.load_state(init_params(model.layout, 0))
        step_allocations(model, step=0)
        counts = step_allocations(model, step=1)
        plan = model.plan.total_bytes
        pool_grown = pool.total_bytes() - pool0
        dev_grown = device_used() - dev0
        entry = {"micro_batch": micro, "plan_bytes": plan, "engine_own_bytes": engine.own_bytes,
                 "pool_bytes": pool_grown, "device_bytes": dev_grown,
                 "pool_slack_bytes": pool_grown - plan, "device_slack_bytes": dev_grown - plan,
                 "step_pool_requests": counts["pool_requests"],
                 "step_used_delta": counts["used_after"] - counts["used_before"]}
        entry["ok"] = entry["step_pool_requests"] == 0 and entry["step_used_delta"] == 0
        out[key] = entry
        log(f"{key} B={micro}: plan {plan / 2**20:,.1f} MiB (engine's own {engine.own_bytes / 2**20:.1f} MiB "
            f"included); pool {pool_grown / 2**20:,.1f} MiB (plan + {entry['pool_slack_bytes']:,} B); device "
            f"{dev_grown / 2**20:,.1f} MiB (slack {entry['device_slack_bytes'] / 2**20:,.1f} MiB); step: "
            f"{counts['pool_requests']} pool requests, used bytes {counts['used_before']:,} -> {counts['used_after']:,}")
        del model, engine
    free_device_memory()
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def tiny_run_setup(prefix: str, steps: int, intervals: dict, precision: str = "fp32") -> tuple[Path, Path, Path]:
    """A work folder with the tiny experiment (`steps` optimizer steps) and a small repeating corpus."""
    from andrea.shards import write_shard

    work = Path(tempfile.mkdtemp(prefix=prefix))
    raw = json.loads((EXPERIMENTS / "ANDREA-tiny-TRAIN.json").read_text())
    raw["train"] = {"steps": steps}
    raw["intervals"] = intervals
    raw["precision"] = precision
    experiment = work / "tiny.json"
    experiment.write_text(json.dumps(raw))
    data = work / "data"
    data.mkdir()
    pattern = np.random.default_rng(0).integers(0, 512, 300)
    write_shard(data / "train.bin", np.tile(pattern, 200))
    write_shard(data / "val.bin", np.tile(pattern, 20))
    return work, experiment, data


def train_cmd(experiment: Path, data: Path, out: Path, engine: str, stop: int, *extra) -> list:
    return [sys.executable, "-m", "andrea.cli", "train", "--experiment", str(experiment), "--data", str(data),
            "--out", str(out), "--engine", engine, "--max-steps", str(stop), *extra]


TRAIN_ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@section("resume")
def resume():
    """SIGTERM during a CUDA run, then --resume: the final checkpoint must equal an unbroken run's."""
    out = {p: resume_run(p) for p in ("fp32", "bf16")}
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def resume_run(precision: str) -> dict:
    # Validation every step slows the run enough for the signal to land mid-run; it does not touch
    # the weights, so the trajectory is the same.
    work, experiment, data = tiny_run_setup("andrea-resume-", 400,
                                            {"checkpoint": 1000, "sample": 0, "eval": 1, "eval_batches": 8}, precision)
    stop = 60

    def cmd(out, *extra):
        return train_cmd(experiment, data, out, RESUME_ENGINE, stop, *extra)

    def steps_logged(loss_file):
        if not loss_file.is_file():
            return 0
        return sum(1 for line in loss_file.read_text().splitlines() if line.strip() and '"event"' not in line)

    whole = subprocess.run(cmd(work / "whole.ckpt"), capture_output=True, text=True, timeout=300, env=TRAIN_ENV)
    if whole.returncode:
        return {"ok": False, "error": f"unbroken run failed ({whole.returncode}): {whole.stderr[-3000:]}"}
    broken_ckpt = work / "broken.ckpt"
    proc = subprocess.Popen(cmd(broken_ckpt), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=TRAIN_ENV)
    deadline = time.time() + 120
    while steps_logged(work / "broken.loss.json") < 5 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    signalled_at = steps_logged(work / "broken.loss.json")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    stopped_rc = proc.returncode
    stopped_step = int(np.frombuffer(broken_ckpt.read_bytes()[:4], dtype="<i4")[0]) if broken_ckpt.is_file() else None
    again = subprocess.run(cmd(broken_ckpt, "--resume"), capture_output=True, text=True, timeout=300, env=TRAIN_ENV)
    same = (work / "whole.ckpt").read_bytes() == broken_ckpt.read_bytes() if broken_ckpt.is_file() else False
    out = {"signalled_after_steps": signalled_at, "sigterm_exit_code": stopped_rc, "stopped_at_step": stopped_step,
           "resume_exit_code": again.returncode, "final_step": stop, "identical_to_unbroken": same,
           "ok": stopped_rc == 0 and stopped_step is not None and stopped_step < stop and again.returncode == 0 and same}
    if not out["ok"]:
        out["stderr"] = (stderr[-2000:], again.stderr[-2000:])
    log(precision + ": " + json.dumps({k: v for k, v in out.items() if k != "stderr"}))
    return out


@section("cross")
def cross():
    """Train 5 steps on one engine, resume to 10 on the other; compare each step's loss and the final
    checkpoint's weights with 10 steps on the NumPy engine alone."""
    from andrea.layout import ParameterLayout

    work, experiment, data = tiny_run_setup("andrea-cross-", CROSS_STEPS,
                                            {"checkpoint": 1000, "sample": 0, "eval": 0, "eval_batches": 2})

    def run(name, engines):
        """Train to CROSS_STEPS, one leg per engine (the first stops half-way, the second resumes)."""
        ckpt = work / f"{name}.ckpt"
        stops = [CROSS_STEPS // 2, CROSS_STEPS] if len(engines) == 2 else [CROSS_STEPS]
        for i, (engine, stop) in enumerate(zip(engines, stops)):
            r = subprocess.run(train_cmd(experiment, data, ckpt, engine, stop, *(["--resume"] if i else [])),
                               capture_output=True, text=True, timeout=300, env=TRAIN_ENV)
            if r.returncode:
                raise RuntimeError(f"{name}: {engine} to step {stop} failed ({r.returncode}): {r.stderr[-2000:]}")
        records = [json.loads(line) for line in ckpt.with_suffix(".loss.json").read_text().splitlines() if line.strip()]
        losses = {rec["step"]: rec["loss"] for rec in records if "event" not in rec and "loss" in rec}
        n = ParameterLayout(SHAPES["tiny"]).n_params
        weights = np.frombuffer(ckpt.read_bytes()[8:8 + 4 * n], dtype="<f4").astype(np.float64)
        return [losses[s] for s in range(1, CROSS_STEPS + 1)], weights

    ref_losses, ref_w = run("numpy", ("numpy",))
    out = {"steps": CROSS_STEPS, "switch_at": CROSS_STEPS // 2, "numpy_losses": ref_losses}
    for first, second in (("cuda", "numpy"), ("numpy", "cuda")):
        name = f"{first}_then_{second}"
        losses, w = run(name, (first, second))
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        w_rel = float(np.linalg.norm(w - ref_w) / np.linalg.norm(ref_w))
        out[name] = {"losses": losses, "max_rel_loss_diff": rel, "final_weights_rel": w_rel, "ok": rel <= CROSS_LIMIT}
        log(f"{first} to step {CROSS_STEPS // 2}, {second} to {CROSS_STEPS}: max rel loss diff vs numpy {rel:.1e}, "
            f"final weights rel {w_rel:.1e}")
    out["ok"] = all(out[k]["ok"] for k in ("cuda_then_numpy", "numpy_then_cuda"))
    return out


def op_calls(model) -> dict:
    """Each op of one step on the model's own buffers (layer 0 for the per-layer ops)."""
    e, b, P, W, G, H = model.engine, model.buf, model.P, model.W, model.G, model.shape.n_head
    p, w, g, res = P["layers"][0], W["layers"][0], G["layers"][0], b["residual"]
    n_pos = model.micro_batch * model.shape.seq_len
    ln1, ln2, act = model.saved("ln1", 0), model.saved("ln2", 0), model.saved("mlp_act", 0)
    gelu = "gelu" in model.recompute
    dpre = b["mlp_act"] if gelu else b["d_mlp_pre"]
    piece = b["probs"].shape[0]  # sequences of one classifier piece (loss_chunks)
    lnf, targets, probs = b["lnf"][:piece], b["targets"][:piece], b["probs"]
    return {
        "embed_fwd": lambda: e.embed_fwd(res[0], b["tokens"], P["wte"], P["wpe"]),
        "layernorm_fwd": lambda: e.layernorm_fwd(ln1, b["ln1_mean"][0], b["ln1_rstd"][0], res[0],
                                                 p["LN1.gamma"], p["LN1.beta"]),
        "attn_qkv_fwd": lambda: e.attn_qkv_fwd(b["qkv"][0], ln1, w["W_QKV"]),
        "attn_fwd": lambda: e.attn_fwd(b["atty"][0], b["att"][0], b["qkv"][0], H),
        "attn_out_fwd": lambda: e.attn_out_fwd(b["branch"], b["atty"][0], w["W_O"]),
        "residual_layernorm_fwd": lambda: e.residual_layernorm_fwd(b["residual_mid"][0], ln2, b["ln2_mean"][0],
                                                                   b["ln2_rstd"][0], res[0], b["branch"],
                                                                   p["LN2.gamma"], p["LN2.beta"]),
        "mlp_fwd": lambda: e.mlp_fwd(b["branch"], b["mlp_pre"][0], act, ln2, w["W_1"], w["W_2"]),
        "loss_fwd": lambda: e.loss_fwd(b["losses"][:piece], probs, lnf, W["wte"], targets),
        "loss_bwd": lambda: e.loss_bwd(b["d_ln"][:piece], G["wte"], probs, lnf, W["wte"], targets, 1.0 / n_pos),
        "mlp_bwd": lambda: e.mlp_bwd(b["d_ln"], g["W_1"], g["W_2"], dpre, b["d_branch"], ln2,
                                     b["mlp_pre"][0], act, w["W_1"], w["W_2"], recompute=gelu),
        "layernorm_residual_bwd": lambda: e.layernorm_residual_bwd(b["d_residual"], b["d_branch"], g["LN2.gamma"],
                                                                   g["LN2.beta"], b["d_ln"], b["residual_mid"][0],
                                                                   p["LN2.gamma"], b["ln2_mean"][0], b["ln2_rstd"][0]),
        "layernorm_bwd": lambda: e.layernorm_bwd(b["d_residual"], g["LN1.gamma"], g["LN1.beta"], b["d_ln"],
                                                 res[0], p["LN1.gamma"], b["ln1_mean"][0], b["ln1_rstd"][0]),
        "attn_out_bwd": lambda: e.attn_out_bwd(b["d_atty"], g["W_O"], b["d_branch"], b["atty"][0], w["W_O"]),
        "attn_bwd": lambda: e.attn_bwd(b["d_qkv"], b["d_att"], b["d_atty"], b["qkv"][0], b["atty"][0], b["att"][0], H),
        "attn_qkv_bwd": lambda: e.attn_qkv_bwd(b["d_ln"], g["W_QKV"], b["d_qkv"], ln1, w["W_QKV"]),
        "embed_bwd": lambda: e.embed_bwd(G["wte"], G["wpe"], b["d_residual"], b["tokens"]),
        "grad_norm": lambda: (e.grad_norm_partial(b["grad_norm_partials"], b["grads"]),
                              e.grad_norm_final(b["grad_norm"], b["grad_norm_partials"])),
        "adamw_step": lambda: e.adamw_step(b["params"], b["grads"], b["m"], b["v"], lr=1e-4, beta1=0.9, beta2=0.95,
                                           eps=1e-8, weight_decay=0.1, step=1, decay_ranges=model.layout.decay_ranges(),
                                           params_lp=b.get("params_lp")),
    }


# calls of each op in one training step of one micro-batch (grad_norm and AdamW once per step); the
# classifier's once per loss piece
def per_step_calls(op: str, L: int, loss_pieces: int = 1) -> int:
    if op in ("loss_fwd", "loss_bwd"):
        return loss_pieces
    if op in ("embed_fwd", "embed_bwd", "layernorm_fwd", "layernorm_bwd", "grad_norm", "adamw_step"):
        return 1
    if op in ("residual_layernorm_fwd", "layernorm_residual_bwd"):
        return 2 * L
    return L


BENCH_VARIANTS = (*PRECISIONS, "bf16-eager")
PEER_VARIANTS = ("fp32", "tf32", "bf16", "bf16-compile")


@section("bench")
def bench(baseline: str | None, variants=BENCH_VARIANTS, peers=PEER_VARIANTS):
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.model import Model, init_params

    out = {"engine": {}, "ops": {}, "baseline": {}}
    for shape_name, micro in BENCH.items():
        shape = SHAPES[shape_name]
        tokens = micro * shape.seq_len
        # "bf16-eager": the same step launched op by op from the host instead of replayed as a CUDA graph
        for variant in variants:
            precision = variant.split("-")[0]
            model = Model(CudaEngine(precision=precision), shape, micro, graphs=variant != "bf16-eager",
                          **options(shape_name, precision))
            model.load_state(init_params(model.layout, 0))
            batches = [synthetic_micro_batches(shape, micro, 1, s) for s in range(4)]
            times = []
            for step in range(13):
                t0 = time.perf_counter()
                model.train_step(batches[step % 4], step=step, lr=lr_at(step), optimizer=OPTIMIZER)
                model.engine.synchronize()
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times[3:]) * 1e3
            out["engine"][f"{shape_name}/{variant}"] = {"micro_batch": micro, "ms_per_step": round(ms, 2),
                                                        "tokens_per_s": round(tokens / ms * 1e3)}
            if variant == "bf16-eager":
                log(f"{shape_name} {variant} B={micro}: {ms:.2f} ms/step, {tokens / ms * 1e3:,.0f} tokens/s")
                del model
                free_device_memory()
                continue
            ops_ms = {}
            piece = model.buf["probs"].shape[0]  # the loss ops run on one piece of the micro-batch
            for op, fn in op_calls(model).items():
                flops, nbytes = op_cost(op, shape, piece if op.startswith("loss") else micro, model.layout.n_params,
                                        2 if precision in LOW else 4)
                t = graph_ms(model.engine, fn)
                ops_ms[op] = {"ms": round(t, 4), "gflop": round(flops / 1e9, 3), "mbytes": round(nbytes / 1e6, 2),
                              "tflop_s": round(flops / t / 1e9, 1), "tb_s": round(nbytes / t / 1e9, 2),
                              "calls_per_step": per_step_calls(op, shape.n_layer, -(-micro // piece))}
            out["ops"][f"{shape_name}/{precision}"] = ops_ms
            log(f"{shape_name} {precision} B={micro}: {ms:.2f} ms/step, {tokens / ms * 1e3:,.0f} tokens/s; ops "
                + ", ".join(f"{op} {v['ms']:.3f}" for op, v in ops_ms.items()))
            del model
            free_device_memory()
    if baseline:
        for shape_name in BENCH:
            for variant in peers:
                r = subprocess.run([sys.executable, baseline, BASELINE_SHAPE[shape_name], variant, "20"],
                                   capture_output=True, text=True, timeout=500)
                lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
                if r.returncode or not lines:
                    out["baseline"][f"{shape_name}/{variant}"] = {"error": r.stderr[-2000:]}
                    log(f"baseline {shape_name} {variant} failed: {r.stderr[-500:]}")
                    continue
                out["baseline"][f"{shape_name}/{variant}"] = json.loads(lines[-1])
                log(f"baseline {shape_name} {variant}: {lines[-1]}")
    return out


# ---- the table -----------------------------------------------------------------------------
def fmt_bytes(n):
    return f"{n / 2**20:,.1f} MiB"


def table() -> str:
    lines = []
    add = lines.append
    dev = report.get("device", {})
    add(f"GPU check on {dev.get('name', '?')} ({dev.get('sms', '?')} SMs), CUDA runtime {dev.get('runtime', '?')}, "
        f"CuPy {dev.get('cupy', '?')}")
    c = report.get("ceilings", {})
    if "copy_tb_s" in c:
        add(f"ceilings measured here: cuBLAS 8192^3 fp32 {c['fp32_tflops']} TFLOP/s, tf32 {c['tf32_tflops']}, "
            f"bf16 {c.get('bf16_tflops')}, fp16 {c.get('fp16_tflops')} TFLOP/s; "
            f"device copy {c['copy_tb_s']} TB/s")
    for name in ("build", "ops", "train", "parity", "determinism", "memory", "resume", "cross", "bench"):
        if "error" in report.get(name, {}):
            add(f"{name}: ERROR (see log)")
    if "rows" in report.get("ops", {}):
        add("")
        add("ops vs float64 NumPy (worst output's ||got-ref||/||ref||, max abs over outputs); limits "
            + ", ".join(f"{p} {LIMITS[p]:.0e}" for p in PRECISIONS))
        shapes = {r["shape"]: f"{r['shape']} B={r['B']} T={r['T']}" for r in report["ops"]["rows"]}
        add(f"{'op':14}" + "".join(f"| {label:<{18 * len(PRECISIONS) - 1}}" for label in shapes.values()))
        add(f"{'':14}" + ("| " + "".join(f"{p + ' rel':>8} {'abs':>7}  " for p in PRECISIONS)[:-1]) * len(shapes))
        for op in OPS:
            cells = []
            for shape_name in shapes:
                rs = {r["precision"]: r for r in report["ops"]["rows"] if r["shape"] == shape_name and r["op"] == op}
                cells.append("| " + " ".join(
                    f"{rs[p]['rel']:8.1e} {rs[p]['max_abs']:7.1e}{'!' if not rs[p]['ok'] else ' '}" if p in rs else " " * 17
                    for p in PRECISIONS) + " ")
            add(f"{op:14}" + "".join(cells))
    t = report.get("train", {})
    if "tiny" in t:
        add("")
        add(f"train: {TRAIN_STEPS} steps from one init, NumPy fp32 vs CUDA (max |dloss|/loss; final params rel)")
        for shape_name in TRAIN:
            e = t[shape_name]
            add(f"  {shape_name:5} B={e['micro_batch']}x{e['micro_batches']}: numpy loss {e['numpy_losses'][0]:.4f} -> "
                f"{e['numpy_losses'][-1]:.4f}; " + "; ".join(
                    f"{p} {e[p]['losses'][-1]:.4f} diff {e[p]['max_rel_loss_diff']:.1e} params {e[p]['final_params_rel']:.1e}"
                    f"{'' if e[p]['ok'] else ' FAIL'}" for p in PRECISIONS))
    pa = report.get("parity", {})
    if "final_rel" in pa:
        add(f"parity: 12M B={pa['micro_batch']}, {pa['steps']} steps from one init: final loss fp32 {pa['fp32_losses'][-1]:.4f}, "
            f"bf16 {pa['bf16_losses'][-1]:.4f}, rel diff {pa['final_rel']:.2e} (limit {PARITY_LIMIT:.0e}; last 10 steps' "
            f"mean {pa['last10_rel']:.2e}){'' if pa['ok'] else ' FAIL'}")
    d = report.get("determinism", {})
    if "ok" in d:
        add("determinism: " + ", ".join(f"{k} {v['steps']} steps {'same bits' if v['same_bits'] else 'DIFFERENT'}"
                                        for k, v in d.items() if isinstance(v, dict)))
    m = report.get("memory", {})
    baseline = report.get("bench", {}).get("baseline", {})
    for key, e in m.items():
        if isinstance(e, dict) and "plan_bytes" in e:
            shape_name, precision = key.split("/")
            variants = ("bf16-compile",) if precision == "bf16" else ("fp32", "tf32")
            peaks = {v: baseline.get(f"{shape_name}/{v}", {}).get("peak_mem_gib") for v in variants}
            peak = max((p for p in peaks.values() if p is not None), default=None)
            versus = (f"; PyTorch peak allocated {peak:.2f} GiB -> pool {e['pool_bytes'] / 2**30:.2f} GiB is "
                      f"{'within' if e['pool_bytes'] <= peak * 2**30 else 'OVER'}" if peak else "")
            add(f"memory {key} B={e['micro_batch']}: plan {fmt_bytes(e['plan_bytes'])} (engine's own "
                f"{fmt_bytes(e['engine_own_bytes'])} included); CuPy pool {fmt_bytes(e['pool_bytes'])} (= plan + "
                f"{e['pool_slack_bytes']:,} B padding); device used +{fmt_bytes(e['device_bytes'])} (slack "
                f"{fmt_bytes(e['device_slack_bytes'])}); pool requests in a step: {e['step_pool_requests']}{versus}")
    for precision, r in report.get("resume", {}).items():
        if isinstance(r, dict) and "identical_to_unbroken" in r:
            add(f"resume {precision}: SIGTERM after {r['signalled_after_steps']} steps -> exit {r['sigterm_exit_code']} at "
                f"step {r['stopped_at_step']}; --resume -> exit {r['resume_exit_code']}; final ckpt "
                f"{'identical to' if r['identical_to_unbroken'] else 'DIFFERENT from'} the unbroken run's")
    x = report.get("cross", {})
    if "numpy_then_cuda" in x:
        add(f"cross-engine resume (tiny, {x['steps']} steps, switch at {x['switch_at']}; vs all-NumPy, limit "
            f"{CROSS_LIMIT:.0e}): " + "; ".join(
                f"{k.replace('_', ' ')}: max rel loss diff {x[k]['max_rel_loss_diff']:.1e}, final weights rel "
                f"{x[k]['final_weights_rel']:.1e}{'' if x[k]['ok'] else ' FAIL'}" for k in ("cuda_then_numpy", "numpy_then_cuda")))
    b = report.get("bench", {})
    if b.get("engine"):
        add("")
        add("train_step tokens/s (median of 10 steps after 3 warm-up; one micro-batch per step)")
        add(f"{'shape':14}{'precision v peer':22}{'ANDREA ms':>10}{'tokens/s':>12}{'PyTorch ms':>12}{'tokens/s':>12}{'ratio':>8}")
        for key, e in b["engine"].items():
            shape_name, precision = key.split("/")
            base = b.get("baseline", {}).get(key.replace("-eager", ""), {})
            peers = [(precision, base)]
            if precision == "bf16":  # the peer that counts: bf16 + torch.compile
                peers.append(("bf16-compile", b.get("baseline", {}).get(f"{shape_name}/bf16-compile", {})))
            for variant, base in peers:
                ratio = f"{e['tokens_per_s'] / base['tokens_per_s']:.2f}" if "tokens_per_s" in base else "-"
                add(f"{shape_name + ' B=' + str(e['micro_batch']):14}{precision + ' v ' + variant:22}{e['ms_per_step']:>10.2f}"
                    f"{e['tokens_per_s']:>12,}{base.get('ms_per_step', float('nan')):>12.2f}"
                    f"{base.get('tokens_per_s', 0):>12,}{ratio:>8}")
    verdicts = {name: report.get(name, {}).get("ok") for name in CHECKED}
    add("")
    add("verdict: " + ", ".join(f"{k} {'ok' if v else ('skipped' if v is None else 'FAIL')}" for k, v in verdicts.items()))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "results/gpu_check"))
    parser.add_argument("--baseline", default=str(REPO / ".device" / "bench" / "torch_baseline.py"),
                        help="the PyTorch peer baseline script (skipped if missing)")
    parser.add_argument("--sections", default="device,build,ceilings,ops,train,parity,determinism,memory,resume,cross,bench")
    parser.add_argument("--bench", default=",".join(BENCH_VARIANTS), help="engine variants the bench section times")
    parser.add_argument("--peers", default=",".join(PEER_VARIANTS), help="PyTorch baseline variants it runs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = {"device": device_info, "build": build, "ceilings": ceilings, "ops": ops, "train": train,
             "parity": parity, "determinism": determinism, "memory": memory, "resume": resume, "cross": cross,
             "bench": lambda: bench(args.baseline if Path(args.baseline).is_file() else None,
                                    args.bench.split(","), args.peers.split(","))}
    for name in args.sections.split(","):
        steps[name]()
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    text = table()
    (out / "gpu_check.txt").write_text(text + "\n")
    log("\n" + text)
    ok = all(report.get(n, {}).get("ok", True) for n in CHECKED)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
