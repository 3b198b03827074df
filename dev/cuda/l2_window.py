"""The backward's activation gradients kept in L2: the benchmark step with an access policy window on its recorded
graph's kernel nodes, against the same graph without, in one process.

    PYTHONPATH=. python3 dev/cuda/l2_window.py [--runs 120M/bf16,12M/bf16,120M/fp8] [--rounds 3]
        [--windows d_residual,d_ln+d_branch,d_residual+d_ln+d_branch] [--set-aside 4,12,24,31.25] [--keep]

A window names plan buffers (joined by +; they must lie next to each other in the plan's allocation): every
kernel node of the step's micro-batch graph gets CUDA's access policy window over their span, hits PERSISTING
at hitRatio = the set-aside / the span, and the node of the embedding's backward (the last reader of
d_residual) the same window with hits NORMAL, which puts the persisting lines back to normal before the next
forward (--keep: each window also without that). The set-aside is cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE),
each of --set-aside's in turn (in MiB, at most the device's largest; the driver rounds it), after none; under each,
the plain graph runs first, then each window's. Each run starts from the same init and runs scripts/bench.py's 23
steps; its ms a step and the weights' sha256 are printed, then each variant's median against the plain graph's
without a set-aside, and the script exits 1 where a variant's weights differ from that graph's (a cache policy
moves no bit).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import cupy  # noqa: E402

from andrea.engines import graphs  # noqa: E402
from andrea.engines.graphs import RecordedGraph, _call, _KernelParams, _listed, _type  # noqa: E402
from bench import per_step_ms  # noqa: E402
from step_idle import bench_model  # noqa: E402

CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38
CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
NORMAL, STREAMING, PERSISTING = 0, 1, 2
KERNEL = 0


class _Window(ctypes.Structure):  # CUaccessPolicyWindow
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _AttrValue(ctypes.Union):  # CUlaunchAttributeValue (64 bytes)
    _fields_ = [("pad", ctypes.c_char * 64), ("window", _Window)]


def _lib():
    lib = graphs._driver()
    p = ctypes.c_void_p
    for name, args in {"cuGraphKernelNodeSetAttribute": (p, ctypes.c_int, ctypes.POINTER(_AttrValue)),
                       "cuGraphKernelNodeGetParams_v2": (p, ctypes.POINTER(_KernelParams)),
                       "cuCtxSetLimit": (ctypes.c_int, ctypes.c_size_t),
                       "cuCtxGetLimit": (ctypes.POINTER(ctypes.c_size_t), ctypes.c_int),
                       "cuDeviceGetAttribute": (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int)}.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def device_attr(attr: int) -> int:
    _lib()
    v = ctypes.c_int(0)
    _call("cuDeviceGetAttribute", ctypes.byref(v), attr, cupy.cuda.Device().id)
    return v.value


def set_aside(nbytes: int) -> int:
    _lib()
    _call("cuCtxSetLimit", CU_LIMIT_PERSISTING_L2_CACHE_SIZE, nbytes)
    got = ctypes.c_size_t(0)
    _call("cuCtxGetLimit", ctypes.byref(got), CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
    return got.value


def windowed(graph, base: int, nbytes: int, ratio: float, demote: set[int]):
    """`graph` (RecordedGraph or CuPy Graph) instantiated again with the window on each kernel node."""
    _lib()
    handle = graph.graph
    count = {"persisting": 0, "normal": 0}
    for node in _listed("cuGraphGetNodes", handle):
        if _type(node) != KERNEL:
            continue
        params = _KernelParams()
        _call("cuGraphKernelNodeGetParams_v2", node, ctypes.byref(params))
        normal = params.func in demote
        value = _AttrValue()
        value.window = _Window(base, nbytes, ratio, NORMAL if normal else PERSISTING, NORMAL)
        _call("cuGraphKernelNodeSetAttribute", node, CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW, ctypes.byref(value))
        count["normal" if normal else "persisting"] += 1
    exec_handle = ctypes.c_void_p()
    _call("cuGraphInstantiateWithFlags", ctypes.byref(exec_handle), handle, 0)
    return RecordedGraph(getattr(graph, "recorded", graph), exec_handle.value), count


def span(model, names: list[str]) -> tuple[int, int]:
    arrays = sorted((model.buf[n] for n in names), key=lambda a: a.data.ptr)
    for a, b in zip(arrays, arrays[1:]):
        gap = b.data.ptr - (a.data.ptr + a.nbytes)
        if not 0 <= gap < 4096:
            raise SystemExit(f"window {'+'.join(names)}: the buffers are not next to each other (gap {gap} bytes)")
    return arrays[0].data.ptr, arrays[-1].data.ptr + arrays[-1].nbytes - arrays[0].data.ptr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="120M/bf16,12M/bf16,120M/fp8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--windows", default="d_residual,d_ln+d_branch,d_residual+d_ln+d_branch")
    ap.add_argument("--keep", action="store_true", help="also each window without the embedding's demotion")
    ap.add_argument("--set-aside", default="4,12,24,31.25", help="MiB of L2 set aside for persisting lines, each in turn")
    args = ap.parse_args()
    l2, most, window_max = (device_attr(a) for a in (CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
                                                      CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE,
                                                      CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE))
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: L2 {l2 / 2**20:.1f} MiB, persisting at most "
          f"{most / 2**20:.1f} MiB, window at most {window_max / 2**20:.1f} MiB", flush=True)
    from andrea.model import init_params
    bad = 0
    sizes = [int(float(x) * 2**20) for x in args.set_aside.split(",")]
    for run in args.runs.split(","):
        name, precision = run.split("/")
        engine, model = bench_model(name, precision)
        init = init_params(model.layout, 0)
        per_step_ms(model, steps=4, warm=1)  # records the micro-batch graph
        (key, plain), = model._step_graphs.items()
        layout = {n: (model.buf[n].data.ptr, model.buf[n].nbytes) for n in ("d_residual", "d_branch", "d_ln")}
        print(f"{run}: " + ", ".join(f"{n} {p:#x} {b / 2**20:.1f} MiB" for n, (p, b) in layout.items()), flush=True)
        demote = {engine.k[n].kernel.ptr for n in engine.k if n.startswith("k_embed_bwd")}
        results: dict[str, list] = {}

        def timed(label, graph):
            model._step_graphs[key] = graph
            model.load_state(init)
            ms = per_step_ms(model, steps=23, warm=3)
            bits = hashlib.sha256(model.host_state()[0].tobytes()).hexdigest()[:16]
            results.setdefault(label, []).append((ms, bits))
            print(f"  {label}: {ms:.3f} ms  {bits}", flush=True)

        for r in range(args.rounds):
            for size in (0, *sizes):
                limit = set_aside(min(size, most))
                variants = {}
                for w in (args.windows.split(",") if limit else ()):
                    base, nbytes = span(model, w.split("+"))
                    ratio = min(1.0, limit / nbytes)
                    for keep in ((False, True) if args.keep else (False,)):
                        g, count = windowed(plain, base, nbytes, ratio, set() if keep else demote)
                        variants[f"{w}{' kept' if keep else ''} (hit {ratio:.2f})"] = g
                timed(f"plain, set-aside {limit / 2**20:.1f} MiB", plain)
                for label, g in variants.items():
                    timed(f"{label}, set-aside {limit / 2**20:.1f} MiB", g)
        set_aside(0)
        base_ms = statistics.median(ms for ms, _ in results["plain, set-aside 0.0 MiB"])
        plain_bits = results["plain, set-aside 0.0 MiB"][0][1]
        for label, rs in results.items():
            ms = statistics.median(m for m, _ in rs)
            same = all(b == plain_bits for _, b in rs)
            bad += not same
            print(f"{run} {label}: median {ms:.3f} ms ({ms - base_ms:+.3f}, {100 * (ms / base_ms - 1):+.2f}%)"
                  f"{'' if same else '  WEIGHTS DIFFER'}", flush=True)
        model._step_graphs[key] = plain
        model = engine = variants = None  # the next run's buffers in their place
        cupy.get_default_memory_pool().free_all_blocks()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
