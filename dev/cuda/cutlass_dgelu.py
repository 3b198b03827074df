"""The MLP's GELU products on CUTLASS's Hopper kernels against cuBLASLt's, at the shapes of ANDREA's steps.

    python3 dev/cuda/cutlass_dgelu.py --build LIB --cutlass DIR     # once, on any machine with nvcc (about 90 s)
    PYTHONPATH=. python3 dev/cuda/cutlass_dgelu.py --lib LIB [--shapes 120M,12M] [--step 120M,12M [--gelu-aux]]

--build compiles dev/cuda/cutlass_dgelu.cu into the shared library LIB with CUTLASS's headers from DIR (the
`cutlass_library/source` folder of the nvidia-cutlass wheel: `pip download --no-deps nvidia-cutlass==4.2.0.0`, then
unzip it). The run takes fresh random operands at each shape (dout and W_2 scaled as a layer's, pre as a layer's
pre-activations), runs every CUTLASS configuration of the backward's DGELU product and the engine's cuBLASLt one
(the algorithm table's choice), then the plain product of the same operands on both (the mainloops' own rate), then
the forward's GELU_AUX product (pre and act written) on both; it checks each against float64 NumPy on a block of
rows (all use the tanh GELU; CUTLASS a fast tanh) and times each alone in a CUDA graph (timing.graph_ms). It exits 1
where a CUTLASS product that ran is off by more than bf16's rounding allows, or where no DGELU configuration ran.

--step then runs the benchmark's bf16 training step at those shapes (scripts/bench.py's micro-batch and memory
options) on engines in this process: the engine as it is, one whose cuBLASLt DGELU products go to the fastest CUTLASS
configuration that passed at the shape, and with --gelu-aux one whose GELU_AUX products go there too. Their rounds
alternate; it prints the median ms a step of each round and the models' losses (close, not equal: CUTLASS rounds
differently). It exits 1 where the routed model's loss parts from the engine's by more than
--loss-tolerance, or where a routed call did not run on CUTLASS.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).with_suffix(".cu")
SHAPES = {"120M": (8 * 1024, 3072, 768), "12M": (32 * 512, 1536, 384)}  # (tokens N, F, C) of the benchmark's step
CHECK_ROWS = 64  # rows of dpre checked against float64
WORKSPACE_BYTES = 64 << 20
STEP_ROUNDS, STEPS_A_ROUND, WARM_STEPS = 3, 12, 3


def build(lib: Path, cutlass: Path) -> None:
    include = [cutlass / "include", cutlass / "tools" / "util" / "include"]
    missing = [str(p) for p in include if not p.is_dir()]
    if missing:
        raise SystemExit(f"--cutlass {cutlass}: no {', '.join(missing)}; give the wheel's cutlass_library/source")
    cmd = ["nvcc", "-std=c++17", "-O3", "-DNDEBUG", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC",
           "--expt-relaxed-constexpr", *(f"-I{p}" for p in include), "-o", str(lib), str(SOURCE)]
    subprocess.run(cmd, check=True)
    print(f"built {lib}")


def gelu_grad(x: np.ndarray) -> np.ndarray:
    k = np.sqrt(2.0 / np.pi)
    th = np.tanh(k * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3 * 0.044715 * x * x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--build", type=Path, help="compile the library to this path and stop")
    ap.add_argument("--cutlass", type=Path, help="CUTLASS's source folder (with include/) for --build")
    ap.add_argument("--lib", type=Path, help="the library --build made")
    ap.add_argument("--shapes", default="120M,12M")
    ap.add_argument("--step", default="", help="shapes whose bf16 training step is timed with the products routed "
                                               "to CUTLASS against the engine's own (after the products' check)")
    ap.add_argument("--gelu-aux", action="store_true", help="with --step, also a step with the GELU_AUX products routed")
    ap.add_argument("--loss-tolerance", type=float, default=0.02,
                    help="with --step, the largest relative difference of a step's loss between the two models")
    args = ap.parse_args()
    if args.build:
        if not args.cutlass:
            ap.error("--build needs --cutlass")
        build(args.build, args.cutlass)
        return 0
    if not args.lib or not args.lib.is_file():
        ap.error("--lib: the library --build made")
    import cupy
    import ml_dtypes

    sys.path.insert(0, str(REPO))
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.timing import graph_ms

    lib = ctypes.CDLL(str(args.lib))
    lib.andrea_dgelu_config_name.restype = ctypes.c_char_p
    p, i = ctypes.c_void_p, ctypes.c_int
    size, needed_t = ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)
    lib.andrea_dgelu.argtypes = [i, p, p, p, p, i, i, i, p, size, p, needed_t]
    lib.andrea_plain.argtypes = [p, p, p, i, i, i, p, size, p, needed_t]
    lib.andrea_gelu_aux.argtypes = [p, p, p, p, p, i, i, i, p, size, p, needed_t]
    engine = CudaEngine(precision="bf16")
    workspace = cupy.zeros(WORKSPACE_BYTES, dtype=np.uint8)
    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    failed, ran = False, 0
    fastest = {}  # shape: (ms, config) of the fastest DGELU configuration that passed its check

    def empty(rows_, cols):
        return cupy.asarray(np.full((rows_, cols), np.nan, dtype=ml_dtypes.bfloat16))

    def cutlass_call(fn, *ptrs_and_dims):
        """(return code, workspace bytes asked) of a call into the library, on the current stream."""
        needed = ctypes.c_size_t(0)
        code = fn(*ptrs_and_dims, workspace.data.ptr, WORKSPACE_BYTES, cupy.cuda.get_current_stream().ptr,
                  ctypes.byref(needed))
        return code, needed.value

    for shape in args.shapes.split(","):
        N, F, C = SHAPES[shape]

        def draw(*dims, scale):
            host = (rng.standard_normal(dims, dtype=np.float32) * scale).astype(ml_dtypes.bfloat16)
            return host, cupy.asarray(host)

        dout_h, dout = draw(N, C, scale=1.0)
        w2_h, w2 = draw(F, C, scale=F ** -0.5)
        pre_h, pre = draw(N, F, scale=1.5)
        rows = slice(0, CHECK_ROWS)
        want = (dout_h[rows].astype(np.float64) @ w2_h.astype(np.float64).T) * gelu_grad(pre_h[rows].astype(np.float64))
        scale = float(np.abs(want).max())

        def check(name: str, out, want=want, scale=scale, counts=True) -> bool:
            nonlocal failed
            got = cupy.asnumpy(out[rows]).astype(np.float64)
            err = float(np.abs(got - want).max()) / scale
            bad = not err < 1e-2  # bf16 output rounding (2^-9) and the fp32 sums, with room for the fast tanh
            failed |= bad and counts
            print(f"{shape} {name}: max error {err:.2e} of the largest |value|{'  OFF' if bad else ''}", flush=True)
            return not bad

        out = empty(N, F)
        if not engine.blas_lt.gemm(out, dout, w2, N, F, C, trans_b=True, epilogue="dgelu", aux=pre):
            print(f"{shape}: cuBLASLt has no DGELU algorithm for the shape", flush=True)
        else:
            engine.synchronize()
            check("cuBLASLt DGELU", out)
            ms = graph_ms(engine, lambda: engine.blas_lt.gemm(out, dout, w2, N, F, C, trans_b=True, epilogue="dgelu",
                                                              aux=pre))
            print(f"{shape} cuBLASLt DGELU: {ms:.4f} ms", flush=True)
        for config in range(lib.andrea_dgelu_configs()):
            name = lib.andrea_dgelu_config_name(config).decode()
            out = empty(N, F)

            def launch():
                return cutlass_call(lib.andrea_dgelu, config, out.data.ptr, dout.data.ptr, w2.data.ptr, pre.data.ptr,
                                    N, F, C)
            code, needed = launch()
            if code:
                print(f"{shape} CUTLASS {name}: not run (code {code}, workspace {needed} bytes)", flush=True)
                continue
            engine.synchronize()
            ran += 1
            passed = check(f"CUTLASS {name}", out)
            ms = graph_ms(engine, launch)
            print(f"{shape} CUTLASS {name}: {ms:.4f} ms", flush=True)
            if passed and ms < fastest.get(shape, (float("inf"), None))[0]:
                fastest[shape] = (ms, config)

        # the plain product of the same operands: each library's mainloop alone
        plain_want = dout_h[rows].astype(np.float64) @ w2_h.astype(np.float64).T
        plain_scale = float(np.abs(plain_want).max())
        out = empty(N, F)
        engine.blas.gemm(out, dout, w2, N, F, C, trans_b=True)
        engine.synchronize()
        check("cuBLAS plain", out, plain_want, plain_scale, counts=False)
        ms = graph_ms(engine, lambda: engine.blas.gemm(out, dout, w2, N, F, C, trans_b=True))
        print(f"{shape} cuBLAS plain: {ms:.4f} ms", flush=True)
        out = empty(N, F)
        args_plain = (out.data.ptr, dout.data.ptr, w2.data.ptr, N, F, C)
        code, needed = cutlass_call(lib.andrea_plain, *args_plain)
        if code:
            print(f"{shape} CUTLASS plain: not run (code {code}, workspace {needed} bytes)", flush=True)
        else:
            engine.synchronize()
            check("CUTLASS plain", out, plain_want, plain_scale)
            ms = graph_ms(engine, lambda: cutlass_call(lib.andrea_plain, *args_plain))
            print(f"{shape} CUTLASS plain: {ms:.4f} ms", flush=True)

        # the forward's GELU_AUX product: pre = inp @ W_1, act = GELU(pre)
        inp_h, inp = draw(N, C, scale=1.0)
        w1_h, w1 = draw(C, F, scale=C ** -0.5)
        pre_want = inp_h[rows].astype(np.float64) @ w1_h.astype(np.float64)
        k = np.sqrt(2.0 / np.pi)
        act_want = 0.5 * pre_want * (1.0 + np.tanh(k * (pre_want + 0.044715 * pre_want**3)))
        zeros = cupy.asarray(np.zeros(F, dtype=ml_dtypes.bfloat16))
        for lib_name in ("cuBLASLt", "CUTLASS"):
            act, pre_out = empty(N, F), empty(N, F)
            if lib_name == "cuBLASLt":
                def run_gelu_aux():
                    return engine.blas_lt.gemm(act, inp, w1, N, F, C, epilogue="gelu_aux", aux=pre_out)
                ok = run_gelu_aux()
            else:
                args_aux = (act.data.ptr, pre_out.data.ptr, inp.data.ptr, w1.data.ptr, zeros.data.ptr, N, F, C)

                def run_gelu_aux():
                    return cutlass_call(lib.andrea_gelu_aux, *args_aux)
                code, needed = run_gelu_aux()
                ok = code == 0
                if not ok:
                    print(f"{shape} CUTLASS GELU_AUX: not run (code {code}, workspace {needed} bytes)", flush=True)
            if not ok:
                continue
            engine.synchronize()
            counts = lib_name == "CUTLASS"
            check(f"{lib_name} GELU_AUX pre", pre_out, pre_want, float(np.abs(pre_want).max()), counts)
            check(f"{lib_name} GELU_AUX act", act, act_want, float(np.abs(act_want).max()), counts)
            ms = graph_ms(engine, run_gelu_aux)
            print(f"{shape} {lib_name} GELU_AUX: {ms:.4f} ms", flush=True)
    if not ran:
        print("no CUTLASS configuration ran", flush=True)
    del engine, workspace
    for shape in filter(None, args.step.split(",")):
        if shape not in fastest:
            print(f"{shape} step: no DGELU configuration passed at the shape (--shapes must include it)", flush=True)
            failed = True
            continue
        failed |= not step_ab(lib, shape, fastest[shape][1], args.gelu_aux, args.loss_tolerance)
    return 1 if failed or not ran else 0


def route_to_cutlass(engine, lib, config: int, gelu_aux: bool) -> dict:
    """Sends the engine's bf16 DGELU products (and with `gelu_aux` its GELU_AUX products) to the library's
    configuration `config` instead of cuBLASLt: the engine's own call where the product takes anything else (FP8,
    a transpose, alpha, beta, a batch). Returns the counts of calls routed and of routed calls CUTLASS refused."""
    import cupy

    workspace = cupy.zeros(WORKSPACE_BYTES, dtype=np.uint8)
    zeros = {}  # F: a bias of zeros (CUTLASS's GELU_AUX epilogue adds one)
    counts = {"dgelu": 0, "gelu_aux": 0, "refused": 0}
    own = engine.blas_lt.gemm

    def gemm(c, a, b, m, n, k, **kw):
        epilogue = kw.get("epilogue", "none")
        plain = (all(kw.get(name) is None for name in ("a_type", "b_type", "d_type", "algo"))
                 and kw.get("alpha", 1.0) == 1.0 and kw.get("beta", 0.0) == 0.0 and kw.get("batch", 1) == 1
                 and not kw.get("trans_a") and c.dtype.itemsize == 2)
        stream = cupy.cuda.get_current_stream().ptr
        needed = ctypes.c_size_t(0)
        code = None
        if plain and epilogue == "dgelu" and kw.get("trans_b"):
            counts["dgelu"] += 1
            code = lib.andrea_dgelu(config, c.data.ptr, a.data.ptr, b.data.ptr, kw["aux"].data.ptr, m, n, k,
                                    workspace.data.ptr, WORKSPACE_BYTES, stream, ctypes.byref(needed))
        elif plain and gelu_aux and epilogue == "gelu_aux" and not kw.get("trans_b"):
            counts["gelu_aux"] += 1
            if n not in zeros:
                zeros[n] = cupy.zeros(n, dtype=c.dtype)
            code = lib.andrea_gelu_aux(c.data.ptr, kw["aux"].data.ptr, a.data.ptr, b.data.ptr, zeros[n].data.ptr, m,
                                       n, k, workspace.data.ptr, WORKSPACE_BYTES, stream, ctypes.byref(needed))
        if code == 0:
            return True
        counts["refused"] += code is not None
        return own(c, a, b, m, n, k, **kw)

    engine.blas_lt.gemm = gemm
    return counts


def step_ab(lib, shape: str, config: int, gelu_aux: bool, tolerance: float) -> bool:
    """The benchmark's bf16 step at `shape` on the engine as it is, with its DGELU products on CUTLASS and, with
    `gelu_aux`, with its GELU_AUX products too, rounds alternating; True where every routed call ran on CUTLASS and
    the losses agree with the engine's within `tolerance`."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench import BENCH, EXPERIMENTS, OPTIMIZER, lr_at, options

    from andrea.engines.crosscheck import synthetic_micro_batches
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.model import Model, init_params

    model_shape, micro = EXPERIMENTS[shape].model, BENCH[shape]
    batches = [synthetic_micro_batches(model_shape, micro, 1, s) for s in range(4)]
    variants = {"cuBLASLt": None, "DGELU on CUTLASS": False}
    if gelu_aux:
        variants["DGELU and GELU_AUX on CUTLASS"] = True
    runs = {}
    for name, aux in variants.items():
        engine = CudaEngine(precision="bf16")
        counts = None if aux is None else route_to_cutlass(engine, lib, config, aux)
        model = Model(engine, model_shape, micro, graphs=True, **options(shape))
        model.load_state(init_params(model.layout, 0))
        runs[name] = {"model": model, "counts": counts, "ms": [], "losses": [], "step": 0}
    for _ in range(STEP_ROUNDS):
        for run in runs.values():
            model, times = run["model"], []
            for _ in range(STEPS_A_ROUND):
                step = run["step"]
                t = time.perf_counter()
                loss, _ = model.train_step(batches[step % 4], step=step, lr=lr_at(step), optimizer=OPTIMIZER)
                model.engine.synchronize()
                times.append(time.perf_counter() - t)
                run["losses"].append(float(loss))
                run["step"] += 1
            run["ms"].append(statistics.median(times[WARM_STEPS:]) * 1e3)
    base = runs.pop("cuBLASLt")
    print(f"{shape} bf16 step, engine as it is: " + " / ".join(f"{ms:.3f}" for ms in base["ms"]) + " ms a round",
          flush=True)
    ok = True
    for name, run in runs.items():
        counts = run["counts"]
        worst = max(abs(a - b) / abs(a) for a, b in zip(base["losses"], run["losses"]))
        print(f"{shape} bf16 step, {name} ({lib.andrea_dgelu_config_name(config).decode()}): "
              + " / ".join(f"{ms:.3f}" for ms in run["ms"]) + f" ms a round; routed calls {counts}; losses, last "
              f"{base['losses'][-1]:.5f} / {run['losses'][-1]:.5f}, largest relative difference {worst:.2e}",
              flush=True)
        if counts["refused"] or not counts["dgelu"] or not worst <= tolerance:
            print(f"{shape} {name}: FAILED (refused calls, no routed DGELU, or losses apart by more than {tolerance})",
                  flush=True)
            ok = False
    return ok


if __name__ == "__main__":
    sys.exit(main())
