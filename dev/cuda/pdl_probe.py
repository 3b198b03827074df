"""Programmatic dependent launch (PDL) inside a recorded CUDA graph, on chains like the step's: what a kernel launched
with programmatic stream serialization (cuLaunchKernelEx, through ctypes) saves against a plain launch, after one
of our kernels and after a cuBLAS product, and that its griddepcontrol.wait keeps the chain's results right.

    PYTHONPATH=. python3 dev/cuda/pdl_probe.py

Each chain adds 1 to a buffer of small integers, kernel after kernel (exact in float and bf16), so the final
buffer is the first plus the number of links: a read that ran ahead of its producer shows as a wrong count. The
"no wait" row launches the same chain programmatically with a kernel that skips the wait: it must come out wrong
at the larger size, or the check could not see a race. Exits 1 when a row that should be right is not.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

from andrea.engines.launch import launch_dependent  # noqa: E402

SOURCE = r"""
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;"); }

extern "C" __global__ void k_add1(float* y, const float* x, long long n, int trigger) {
    pdl_wait();
    if (trigger) pdl_trigger();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = x[i] + 1.0f;
}
extern "C" __global__ void k_add1_nowait(float* y, const float* x, long long n, int trigger) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = x[i] + 1.0f;
}
// bf16 held as its bits: small integers convert exactly by the top half of a float
extern "C" __global__ void k_add1_bf16(unsigned short* y, const unsigned short* x, long long n, int trigger) {
    pdl_wait();
    if (trigger) pdl_trigger();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = __uint_as_float(((unsigned)x[i]) << 16) + 1.0f;
        y[i] = (unsigned short)(__float_as_uint(v) >> 16);
    }
}
"""


def launch_pdl(fn, grid, threads, args):
    launch_dependent(fn, grid, threads, args)


def record(fn):
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
    return graph, stream


def time_graph(graph, reps=20):
    graph.launch()
    cupy.cuda.get_current_stream().synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        graph.launch()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def main() -> int:
    from andrea.engines.cuda_engine import CudaEngine

    mod = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
    k = {name: mod.get_function(name) for name in ("k_add1", "k_add1_nowait", "k_add1_bf16")}
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    rng = np.random.default_rng(0)
    bad = []
    links = 200
    print(f"{'chain':44} {'ms':>8} {'us/link':>8}  right")
    for n in (1 << 20, 1 << 24):
        x0 = rng.integers(0, 1000, n).astype(np.float32)
        bufs = [cupy.asarray(x0), cupy.empty(n, np.float32)]
        grid = min(-(-n // 256), 8 * sms)
        for mode in ("plain", "pdl", "pdl+trigger", "pdl no wait"):
            kern = k["k_add1_nowait"] if mode == "pdl no wait" else k["k_add1"]
            trigger = 1 if mode in ("pdl+trigger", "pdl no wait") else 0

            def chain():
                for i in range(links):
                    y, x = bufs[(i + 1) % 2], bufs[i % 2]
                    if mode == "plain":
                        kern((grid,), (256,), (y, x, np.int64(n), np.int32(trigger)))
                    else:
                        launch_pdl(kern, grid, 256, (y, x, np.int64(n), np.int32(trigger)))
            bufs[0].set(x0)
            graph, _s = record(chain)
            graph.launch()
            cupy.cuda.get_current_stream().synchronize()
            right = bool(np.array_equal(cupy.asnumpy(bufs[0]), x0 + links))
            ms = time_graph(graph)
            print(f"{'n=' + str(n) + ' ' + mode:44} {ms:8.3f} {ms / links * 1e3:8.2f}  {right}", flush=True)
            if not right and mode != "pdl no wait":
                bad.append(f"n={n} {mode}")
            if n == 1 << 24 and mode == "pdl no wait" and right:
                print("    (the unwaited chain came out right: this size cannot show a race)")

    # a cuBLAS product, then our kernel on its output, repeated: C = I @ D (exact), D = C + 1
    engine = CudaEngine(precision="bf16")
    m = 1024
    eye = cupy.asarray(np.eye(m, dtype=np.float32).astype("bfloat16"))
    d0 = rng.integers(0, 100, (m, m)).astype(np.float32)
    d = cupy.asarray(d0.astype("bfloat16"))
    c = cupy.empty_like(d)
    links = 50
    for mode in ("plain", "pdl", "pdl+trigger"):
        def chain():
            for _ in range(links):
                engine.blas.gemm(c, eye, d, m, m, m)
                args = (d, c, np.int64(m * m), np.int32(1 if mode == "pdl+trigger" else 0))
                if mode == "plain":
                    k["k_add1_bf16"]((2 * sms,), (256,), args)
                else:
                    launch_pdl(k["k_add1_bf16"], 2 * sms, 256, args)
        d.set(d0.astype("bfloat16"))
        graph, _s = record(chain)
        graph.launch()
        cupy.cuda.get_current_stream().synchronize()
        right = bool(np.array_equal(cupy.asnumpy(d).astype(np.float32), d0 + links))
        d.set(d0.astype("bfloat16"))
        ms = time_graph(graph)
        print(f"{'gemm ' + str(m) + ' + add, ' + mode:44} {ms:8.3f} {ms / links * 1e3:8.2f}  {right}", flush=True)
        if not right:
            bad.append(f"gemm {mode}")
    # a memset node, then our kernel reading what it zeroed: y = 0 + 1, then x = y + 1
    n = 1 << 22
    x, y = cupy.empty(n, np.float32), cupy.empty(n, np.float32)
    for mode in ("plain", "pdl"):
        def chain():
            for _ in range(20):
                cupy.cuda.runtime.memsetAsync(y.data.ptr, 0, y.nbytes, cupy.cuda.get_current_stream().ptr)
                for dst, src in ((y, y), (x, y)):
                    args = (dst, src, np.int64(n), np.int32(0))
                    if mode == "plain":
                        k["k_add1"]((8 * sms,), (256,), args)
                    else:
                        launch_pdl(k["k_add1"], 8 * sms, 256, args)
        x.fill(-5)
        graph, _s = record(chain)
        graph.launch()
        cupy.cuda.get_current_stream().synchronize()
        right = bool((cupy.asnumpy(x) == 2).all())
        ms = time_graph(graph)
        print(f"{'memset + 2 adds, ' + mode:44} {ms:8.3f} {ms / 20 * 1e3:8.2f}  {right}", flush=True)
        if not right:
            bad.append(f"memset {mode}")
    print("wrong: " + (", ".join(bad) if bad else "none"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
