"""How far cuBLASLt's heuristic list is from the fastest algorithm cuBLASLt can run for each product of a step.

    PYTHONPATH=. python3 dev/cuda/lt_search.py [--shapes 120M,12M] [--precisions bf16] [--out DIR]

One eager training step of each shape records every product it runs (scripts/tune_gemm.py's step_products): the
cuBLASLt ones (GELU epilogues, the classifier, FP8) and the plain ones (which cuBLASLt can run, leading dimensions
of their own included). For each product it times, alone, on the step's own buffers:
  - the engine's route today (the table's choice or the heuristic's first; a plain product the table does not
    name, cublasGemmEx), launched from the host: for the smallest products, the launch rate;
  - every algorithm the heuristic offers when asked for up to --heuristics of them;
  - configurations built by hand: every algorithm id cuBLASLt has for the types, each tile and stage count it
    reports, then for the fastest few every CTA swizzle, custom option and cluster shape that cublasLtMatmulAlgoCheck
    accepts, with no split of K; with --split-k, the fastest eight tried so far again with K split in each of those
    counts, their parts summed in place or in a workspace (cuBLASLt's INPLACE and COMPUTE_TYPE reductions, both in a
    fixed order).
Each candidate faster than today is checked against today's output (relative difference, on the same inputs,
the output restored between runs). It prints one line a product, a table last, and writes lt_search.json under
--out. It measures and reports; the engine's table is not changed (scripts/tune_gemm.py writes that).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import cupy  # noqa: E402

from tune_gemm import planned, step_products  # noqa: E402

# cublasLtMatmulAlgoCapAttributes_t and cublasLtMatmulAlgoConfigAttributes_t (cublasLt.h)
CAP_SPLITK, CAP_SWIZZLE, CAP_TILE_IDS, CAP_CUSTOM_MAX, CAP_STAGES_IDS = 0, 2, 6, 7, 13
CFG_ID, CFG_TILE, CFG_SPLITK, CFG_REDUCTION, CFG_SWIZZLE, CFG_CUSTOM, CFG_STAGES, CFG_INNER, CFG_CLUSTER = range(9)
CFG_U16 = (CFG_INNER, CFG_CLUSTER)
CONFIG_NAMES = {CFG_ID: "id", CFG_TILE: "tile", CFG_SPLITK: "splitk", CFG_REDUCTION: "reduction",
                CFG_SWIZZLE: "swizzle", CFG_CUSTOM: "custom", CFG_STAGES: "stages", CFG_INNER: "inner",
                CFG_CLUSTER: "cluster"}


def bind(lib) -> None:
    p, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.cublasLtMatmulAlgoGetIds.argtypes = [p, i, i, i, i, i, i, i, ctypes.POINTER(i), ctypes.POINTER(i)]
    lib.cublasLtMatmulAlgoInit.argtypes = [p, i, i, i, i, i, i, i, p]
    lib.cublasLtMatmulAlgoCapGetAttribute.argtypes = [p, i, p, sz, ctypes.POINTER(sz)]
    lib.cublasLtMatmulAlgoConfigSetAttribute.argtypes = [p, i, p, sz]
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [p, i, p, sz, ctypes.POINTER(sz)]


def cap_list(lib, algo, attr) -> list[int]:
    size = ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.addressof(algo), attr, None, 0, ctypes.byref(size)) or not size.value:
        return []
    buf = (ctypes.c_uint32 * (size.value // 4))()
    lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.addressof(algo), attr, buf, size.value, ctypes.byref(size))
    return list(buf)


def cap_int(lib, algo, attr) -> int:
    v, size = ctypes.c_int32(0), ctypes.c_size_t(0)
    lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.addressof(algo), attr, ctypes.byref(v), 4, ctypes.byref(size))
    return v.value


def config_of(lib, algo) -> dict:
    out = {}
    for attr, name in CONFIG_NAMES.items():
        v = (ctypes.c_uint16 if attr in CFG_U16 else ctypes.c_uint32)(0)
        size = ctypes.c_size_t(0)
        lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.addressof(algo), attr, ctypes.byref(v), ctypes.sizeof(v),
                                                 ctypes.byref(size))
        out[name] = int(v.value)
    return out


def set_config(lib, algo, attr, value) -> None:
    v = (ctypes.c_uint16 if attr in CFG_U16 else ctypes.c_uint32)(value)
    lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.addressof(algo), attr, ctypes.byref(v), ctypes.sizeof(v))


class Product:
    """One recorded product, runnable through cuBLASLt with any algorithm struct."""

    def __init__(self, lt, args, kw):
        from andrea.engines.cublas import Cublas

        self.lt, self.args, self.kw = lt, args, dict(kw)
        self.key, plan = lt._plan_for(*args, **planned(kw))
        self.plan = plan
        c, a, b = args[:3]
        t = lt.TYPES
        # cuBLAS's A is our b, its B our a; an FP8 output's C is bf16 (CublasLt.gemm)
        self.fp8_out = self.key[0] in lt.FP8_OUTPUTS
        self.types = (t[self.key[2]], t[self.key[1]], t["bfloat16" if self.fp8_out else self.key[0]], t[self.key[0]])
        self.compute = Cublas.COMPUTE_32F

    def run(self, result) -> None:
        lt = self.lt
        c, a, b = self.args[:3]
        desc, lay_b, lay_a, lay_c, _, lay_d = self.plan
        aux = self.kw.get("aux")
        if aux is not None and self.kw.get("epilogue") in lt.AUX_EPILOGUES:
            lt._set(desc, lt.DESC_AUX_POINTER, ctypes.c_void_p(aux.data.ptr))
        if self.kw.get("a_scale") is not None:
            lt._set_scales(desc, self.kw["a_scale"], self.kw["b_scale"])
        c_in = aux if self.fp8_out and aux is not None else c  # the D scale and amax pointers stay the recorded call's
        status = lt.lib.cublasLtMatmul(
            lt.handle, desc, lt._scalar(self.kw.get("alpha", 1.0)), b.data.ptr, lay_b, a.data.ptr, lay_a,
            lt._scalar(self.kw.get("beta", 0.0)), c_in.data.ptr, lay_c, c.data.ptr, lay_d, ctypes.byref(result),
            lt.workspace.data.ptr, lt.workspace.nbytes, cupy.cuda.get_current_stream().ptr)
        if status:
            raise RuntimeError(f"cublasLtMatmul status {status}")

    def check(self, algo) -> bool:
        lt = self.lt
        desc, lay_b, lay_a, lay_c, _, lay_d = self.plan
        res = lt._Heuristic()
        st = lt.lib.cublasLtMatmulAlgoCheck(lt.handle, desc, lay_b, lay_a, lay_c, lay_d, ctypes.addressof(algo),
                                            ctypes.byref(res))
        return st == 0 and res.workspace_size <= lt.workspace.nbytes


def ms_of(fn, inner: int = 20, reps: int = 3) -> float:
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / inner)
    return statistics.median(times)


# cublasLtReductionScheme_t: the parts of a split K summed in the output buffer, or in a workspace of the compute type
REDUCTION_INPLACE, REDUCTION_COMPUTE_TYPE = 1, 2
MAX_REL_ERR = 2e-2  # a candidate further than this from today's output does not count


def search(lt, prod: Product, heuristics: int, budget: int, run_default, out_arr, splits: tuple[int, ...] = ()) -> dict:
    lib = lt.lib
    ref_in = out_arr.copy()
    aux = prod.kw.get("aux")
    aux_in = aux.copy() if aux is not None else None

    def restore():
        out_arr[...] = ref_in
        if aux_in is not None:
            aux[...] = aux_in

    def output():
        # gelu_aux writes aux too: compare both
        return out_arr.astype(cupy.float64), (aux.astype(cupy.float64) if aux is not None else None)

    restore()
    run_default()
    ref = output()
    restore()
    today = ms_of(run_default)
    rows, tried = [], []
    seen = set()

    def copy_algo(src):
        algo = lt._Heuristic()
        ctypes.memmove(ctypes.addressof(algo), ctypes.addressof(src), ctypes.sizeof(algo))
        return algo

    def rel(x, y):
        n = float(cupy.linalg.norm(y))
        return float(cupy.linalg.norm(x - y)) / (n if n else 1.0)

    def try_algo(label, algo, cfg):
        restore()
        prod.run(algo)
        got = output()
        err = rel(got[0], ref[0])
        if ref[1] is not None and prod.kw.get("epilogue") == "gelu_aux":
            err = max(err, rel(got[1], ref[1]))
        ms = ms_of(lambda: prod.run(algo))
        rows.append({"label": label, "ms": round(ms, 5), "rel_err": err, "config": cfg})
        tried.append((ms, err, copy_algo(algo)))
        return ms

    def try_variant(label, algo0, settings: dict) -> None:
        """algo0 with the config attributes `settings` set, timed where cuBLASLt accepts it and it is new."""
        algo = copy_algo(algo0)
        for attr, value in settings.items():
            set_config(lib, algo, attr, value)
        if not prod.check(algo):
            return
        cfg = config_of(lib, algo)
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            seen.add(key)
            try_algo(label, algo, cfg)

    # the heuristic's list, long
    desc, lay_b, lay_a, lay_c, _, lay_d = prod.plan
    pref = ctypes.c_void_p()
    lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref))
    limit = ctypes.c_uint64(lt.workspace.nbytes)
    lib.cublasLtMatmulPreferenceSetAttribute(pref, lt.PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), 8)
    results, found = (lt._Heuristic * heuristics)(), ctypes.c_int(0)
    lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, desc, lay_b, lay_a, lay_c, lay_d, pref, heuristics, results,
                                       ctypes.byref(found))
    for i in range(found.value):
        algo = results[i]
        cfg = config_of(lib, algo)
        seen.add(tuple(sorted(cfg.items())))
        try_algo(f"heuristic {i}", algo, cfg)

    # configurations by hand
    n_ids, ids = ctypes.c_int(0), (ctypes.c_int * 256)()
    lib.cublasLtMatmulAlgoGetIds(lt.handle, prod.compute, lt.SCALE_32F, *prod.types, 256, ids, ctypes.byref(n_ids))
    cands = []
    for algo_id in ids[:n_ids.value]:
        base = lt._Heuristic()
        if lib.cublasLtMatmulAlgoInit(lt.handle, prod.compute, lt.SCALE_32F, *prod.types, algo_id,
                                      ctypes.addressof(base)):
            continue
        tiles = cap_list(lib, base, CAP_TILE_IDS) or [0]
        stages = cap_list(lib, base, CAP_STAGES_IDS) or [0]
        for tile in tiles:
            for stage in stages:
                algo = copy_algo(base)
                set_config(lib, algo, CFG_TILE, tile)
                set_config(lib, algo, CFG_STAGES, stage)
                set_config(lib, algo, CFG_SPLITK, 1)
                if prod.check(algo):
                    cfg = config_of(lib, algo)
                    if tuple(sorted(cfg.items())) not in seen:
                        seen.add(tuple(sorted(cfg.items())))
                        cands.append((algo, cfg, base))
    first = sorted(((try_algo("config", algo, cfg), algo, base) for algo, cfg, base in cands[:budget]),
                   key=lambda r: r[0])
    hand_limit = found.value + 2 * budget  # the heuristic's list, then at most 2 x budget built by hand
    for _, algo0, base in first[:6]:
        swz = [0, 1] if cap_int(lib, base, CAP_SWIZZLE) else [0]
        custom = range(min(cap_int(lib, base, CAP_CUSTOM_MAX), 7) + 1)
        for s in swz:
            for cu in custom:
                for cl in range(0, 25):
                    if len(rows) >= hand_limit:
                        break
                    try_variant("config+", algo0, {CFG_SWIZZLE: s, CFG_CUSTOM: cu, CFG_CLUSTER: cl})
    # K split: the fastest eight so far, each count and reduction cuBLASLt accepts for them
    for _, _, algo0 in sorted((t for t in tried if t[1] < MAX_REL_ERR), key=lambda t: t[0])[:8] if splits else ():
        if cap_int(lib, algo0, CAP_SPLITK):
            for sk in splits:
                for red in (REDUCTION_INPLACE, REDUCTION_COMPUTE_TYPE):
                    try_variant("split-k", algo0, {CFG_SPLITK: sk, CFG_REDUCTION: red})
    restore()
    good = [r for r in rows if r["rel_err"] < MAX_REL_ERR]
    best = min(good, key=lambda r: r["ms"]) if good else None
    return {"today_ms": round(today, 5), "heuristics_found": found.value, "configs_checked": len(cands),
            "timed": len(rows), "best": best, "rows": sorted(rows, key=lambda r: r["ms"])[:40]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="120M,12M")
    ap.add_argument("--precisions", default="bf16")
    ap.add_argument("--heuristics", type=int, default=64, help="algorithms asked of the heuristic (default 64)")
    ap.add_argument("--budget", type=int, default=400, help="hand-built configurations timed a product (default 400)")
    ap.add_argument("--split-k", default="", help="K split counts tried on the fastest algorithms (e.g. 2,3,4,8)")
    ap.add_argument("--k", default="", help="only the products of these K (e.g. 8192,16384: the weight gradients)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results/lt_search")))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    splits = tuple(int(x) for x in args.split_k.split(",") if x)
    only_k = {int(x) for x in args.k.split(",") if x}
    report, lines = {}, []
    for name in args.shapes.split(","):
        for precision in args.precisions.split(","):
            engine, model, calls = step_products(name, precision)
            lt = engine.blas_lt
            bind(lt.lib)
            print(f"{name}/{precision}: {len(calls)} products", flush=True)
            for pname, (kind, cargs, kw) in calls.items():
                if only_k and cargs[5] not in only_k:
                    continue
                t0 = time.time()
                prod = Product(lt, cargs, kw)
                # today: the engine's own route (a plain product through the table where it names it)
                run = engine.blas.gemm if kind == "plain" else lt.gemm
                run_default = lambda run=run, cargs=cargs, kw=kw: run(*cargs, **kw)  # noqa: E731
                if prod.plan is None:
                    print(f"  {kind} {pname}: no cuBLASLt plan", flush=True)
                    continue
                res = search(lt, prod, args.heuristics, args.budget, run_default, cargs[0], splits)
                c, a, b, m, n, k = cargs[:6]
                res.update(kind=kind, product=pname, mnk=[m, n, k], gflop=2 * m * n * k * kw.get("batch", 1) / 1e9)
                report[f"{name}/{precision} {kind} {pname}"] = res
                best = res["best"]
                gain = res["today_ms"] - best["ms"] if best else 0.0
                line = (f"{name:5} {precision:5} {kind:5} {m:>6}x{n:<6}x{k:<6} b{kw.get('batch', 1)} "
                        f"{kw.get('epilogue', 'none'):8} today {res['today_ms']:.4f} best {best['ms'] if best else 0:.4f} "
                        f"({gain:+.4f}) {best['label'] if best else '-'} {best['config'] if best else ''} "
                        f"err {best['rel_err'] if best else 0:.1e} h{res['heuristics_found']} c{res['configs_checked']} "
                        f"[{time.time() - t0:.0f}s]")
                print(line, flush=True)
                lines.append(line)
                (args.out / "lt_search.json").write_text(json.dumps(report, indent=1))
            del model, engine
            cupy.get_default_memory_pool().free_all_blocks()
    print("\n".join(["", "product                          today -> best"] + lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
