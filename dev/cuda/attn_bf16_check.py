"""Checks and times the bf16 attention kernels (kernels/attn_bf16.cu and its variants) on a CUDA machine.

    python3 dev/cuda/attn_bf16_check.py [--out DIR] [--source PATH ...] [--variants 1,2,3] [--bench-shapes LIST]
    python3 dev/cuda/attn_bf16_check.py --selftest-reference      (CPU only: checks the float64 reference itself)

Needs cupy and numpy only (of the repository it imports andrea.ops.kernels_build, andrea.ops and andrea.schedule.timing). Each
build is compiled with NVRTC as the engine compiles it (kernels/common.cuh spliced in, -std=c++17) and launched as the
engine launches it (largest shared-memory carveout); its launch shape comes from the module's int[4] constant
attn_bf16_launch {THREADS, ROWS, KV_THREADS, KV_ROWS} when it has one, else from the source's #defines of those names.
Builds:
  --source PATH   a kernel file with the three kernels of kernels/attn_bf16.cu (same names and arguments);
                  repeatable; default the repository's kernels/attn_bf16.cu (through kernel_source(), so
                  ANDREA_KERNELS applies). A file outside the kernels folder gets that folder's common.cuh.
                  A file whose kernels take a launch order (`heads_first`, as kernels/attn_bf16.cu's do) gets
                  the engine's (andrea/ops/attn.py heads_first: each head's tiles together, the grids' dimensions
                  swapped, where every head's K and V pass L2), or as --heads-first 0/1 says; an older file's
                  kernels run their grid's own order.
  --hopper        also builds each of those for sm_90a (as the engine does on Hopper) and checks its warpgroup
                  kernels k_attn_fwd_wg, k_attn_bwd_dq_wg, k_attn_bwd_kv_wg in place of the mma ones.
  --hopper-only   the sm_90a builds alone (a variant that changes only the warpgroup kernels).
  --variants LIST comma-separated values k of ATTN_BF16_VARIANT: a source that reads that macro is built once
                  per k with -DATTN_BF16_VARIANT=k; a source that does not is built once.
Every build goes through every section; the inputs and the float64 references are made once and shared. With
more than one build a comparison table closes the run: one row per (source, variant), its verdict, times and
TFLOP/s at each timed shape, registers and spills; "*" marks the fastest build (fwd + bwd at the first timed
shape) among those that pass every check. Sections:
  correctness  for each shape (B, T, H), head width 64: fresh random bf16 qkv and dY, dqkv pre-filled with random
               bf16 values R (the backward adds into it), out / lse / D poisoned with NaN; fwd, bwd_dq, bwd against
               a float64 NumPy reference from the same bf16 inputs: relative error ||got - ref|| / ||ref|| of Y,
               lse, D, and of dqkv - R for dQ, dK, dV. D is checked against rowsum(dY * Y) of the kernel's own
               (bf16) Y, which is what the kernel is specified to compute; any NaN fails.
  determinism  the full fwd + bwd twice on the same inputs: identical bits of Y, lse, D and dqkv.
  timing       median of 20 runs after 5 warm-ups (CUDA events): fwd, and bwd (both kernels), in ms and TFLOP/s
               over the causal half (one product = B H T^2 hd FLOP; fwd = 2 products, bwd = 5); the two backward
               kernels are also timed alone (dq, kv). At the shapes of --bench-shapes (BxTxH, comma-separated;
               default 8x1024x12,32x512x6, the 120M and 12M steps').
Prints a table last, writes DIR/attn_bf16_check.json (DIR: --out, else $OUT, else results/attn_bf16_check; with
several builds its "builds" list holds one report per build) and exits nonzero if any check of any build fails.
The timing targets are reported, not enforced.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from andrea.ops.kernels_build import COMMON_HEADER, kernel_dir, kernel_source  # noqa: E402
from andrea.ops.attn import launch_order  # noqa: E402
from andrea.ops.fp8 import amax_arg  # noqa: E402
from andrea.schedule.timing import median_ms  # noqa: E402

HD = 64
SHAPES = [(2, 1024, 12), (1, 200, 2), (3, 64, 1), (2, 77, 3), (8, 1024, 12)]  # (B, T, H)
BENCH_SHAPES = [(8, 1024, 12), (32, 512, 6)]
BENCH_NAMES = [f"B{B}_T{T}_H{H}" for B, T, H in BENCH_SHAPES]
LIMITS = {"Y": 1.5e-2, "lse": 1e-3, "D": 1e-3, "dQ": 1.5e-2, "dK": 1.5e-2, "dV": 1.5e-2}
QK_STD = 1.5  # Q and K entries ~ N(0, 1.5^2): S = Q K^T / 8 has std ~2.25
WARMUP, REPEAT = 5, 20
TARGET_MS = {"fwd": 0.10, "bwd": 0.30}  # at (8, 1024, 12)
FWD_PRODUCTS, BWD_PRODUCTS = 2, 5
KERNELS = ("k_attn_fwd_bf16", "k_attn_bwd_dq_bf16", "k_attn_bwd_bf16")  # fwd, dq, kv
HOPPER_KERNELS = ("k_attn_fwd_wg", "k_attn_bwd_dq_wg", "k_attn_bwd_kv_wg")  # the same in the sm_90a build
ROLES = ("fwd", "dq", "kv")
ADD = np.int32(1)  # the backward kernels' `add`: dQ, dK, dV added into dqkv (R here), as the check expects
# The kernels' trailing amax word (precision fp8): none here. Kernels of a file without the argument (older
# variants) ignore a parameter past their own.
NO_AMAX = amax_arg(None)
LAUNCH_SYMBOL = "attn_bf16_launch"  # int[4] {THREADS, ROWS, KV_THREADS, KV_ROWS}, where a kernel file exports it
WG_KV_SMEM_SYMBOL = "attn_wg_kv_smem"  # int: dynamic shared memory of k_attn_bwd_kv_wg, in the sm_90a build
CARVEOUT = 100  # percent of the unified cache given to shared memory: what the engine sets for these kernels


def planes(B, T, C):
    """The backward kernels' last arguments: dqkv's row and plane strides for [3, B, T, C], then no E5M2 image of it
    (null bytes and scale: the gradients in bf16; the variants take none of these)."""
    return np.int32(C), np.int32(B * T * C), np.uint64(0), np.uint64(0)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- bf16 as uint16 bits -----------------------------------------------------------------------------------------
def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float -> bf16 bits (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_round(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(to_bf16_bits(x))


# ---- float64 reference -------------------------------------------------------------------------------------------
def heads(x: np.ndarray, H: int) -> np.ndarray:
    """[B, T, C] -> [B, H, T, hd]"""
    B, T, C = x.shape
    return x.reshape(B, T, H, C // H).transpose(0, 2, 1, 3)


def merge(x: np.ndarray) -> np.ndarray:
    """[B, H, T, hd] -> [B, T, C]"""
    B, H, T, hd = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * hd)


def reference(qkv: np.ndarray, dout: np.ndarray, H: int) -> dict:
    """Causal attention and its gradients in float64, one head at a time. qkv [3, B, T, C], dout [B, T, C] (floats).
    Returns Y [B, T, C], lse [B, H, T] (natural log), D [B, H, T], dqkv [3, B, T, C]."""
    _, B, T, C = qkv.shape
    hd = C // H
    scale = 1.0 / math.sqrt(hd)
    q, k, v = (heads(qkv[i].astype(np.float64), H) for i in range(3))
    dy = heads(dout.astype(np.float64), H)
    future = np.triu(np.ones((T, T), dtype=bool), 1)
    y = np.empty((B, H, T, hd))
    lse = np.empty((B, H, T))
    D = np.empty((B, H, T))
    dq, dk, dv = (np.empty((B, H, T, hd)) for _ in range(3))
    for b in range(B):
        for h in range(H):
            s = (q[b, h] @ k[b, h].T) * scale
            s[future] = -np.inf
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            l = p.sum(axis=1, keepdims=True)
            lse[b, h] = (m + np.log(l))[:, 0]
            p /= l
            y[b, h] = p @ v[b, h]
            dp = dy[b, h] @ v[b, h].T
            D[b, h] = (dy[b, h] * y[b, h]).sum(axis=1)
            ds = p * (dp - D[b, h][:, None]) * scale
            dq[b, h] = ds @ k[b, h]
            dk[b, h] = ds.T @ q[b, h]
            dv[b, h] = p.T @ dy[b, h]
    return {"Y": merge(y), "lse": lse, "D": D, "dqkv": np.stack([merge(dq), merge(dk), merge(dv)])}


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return float("nan")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))


def make_inputs(B: int, T: int, H: int, seed: int) -> dict:
    """bf16 bits of qkv, dout, and the reference computed from their exact values; R (bf16 bits) of the size of the
    reference gradient of each plane."""
    rng = np.random.default_rng(seed)
    C = H * HD
    qkv = rng.standard_normal((3, B, T, C), dtype=np.float32)
    qkv[:2] *= QK_STD
    dout = rng.standard_normal((B, T, C), dtype=np.float32)
    qkv_bits, dout_bits = to_bf16_bits(qkv), to_bf16_bits(dout)
    ref = reference(bf16_bits_to_f32(qkv_bits), bf16_bits_to_f32(dout_bits), H)
    rms = np.sqrt((ref["dqkv"] ** 2).mean(axis=(1, 2, 3)))  # per plane
    R = rng.standard_normal((3, B, T, C)) * rms[:, None, None, None]
    return {"qkv": qkv_bits, "dout": dout_bits, "R": to_bf16_bits(R.astype(np.float32)), "ref": ref}


def compare(inp: dict, got: dict, H: int) -> dict:
    """Relative errors of the kernel outputs `got` (Y, dqkv as bf16 bits; lse, D as float32) against the reference."""
    ref = inp["ref"]
    y = bf16_bits_to_f32(got["Y"]).astype(np.float64)
    d_ref = (heads(bf16_bits_to_f32(inp["dout"]).astype(np.float64), H) * heads(y, H)).sum(axis=-1)
    grad = bf16_bits_to_f32(got["dqkv"]).astype(np.float64) - bf16_bits_to_f32(inp["R"]).astype(np.float64)
    errs = {
        "Y": rel_err(y, ref["Y"]),
        "lse": rel_err(got["lse"], ref["lse"]),
        "D": rel_err(got["D"], d_ref),
        "dQ": rel_err(grad[0], ref["dqkv"][0]),
        "dK": rel_err(grad[1], ref["dqkv"][1]),
        "dV": rel_err(grad[2], ref["dqkv"][2]),
    }
    nan = {k: int(np.isnan(bf16_bits_to_f32(got[k]) if k in ("Y", "dqkv") else got[k]).sum())
           for k in ("Y", "lse", "D", "dqkv")}
    ok = all(math.isfinite(e) and e <= LIMITS[k] for k, e in errs.items()) and not any(nan.values())
    return {"errors": errs, "nan_count": nan,
            "D_vs_exact_Y": rel_err(got["D"], ref["D"]),  # information: D against rowsum(dY * exact Y)
            "pass": bool(ok)}


# ---- reference self-test (CPU) -----------------------------------------------------------------------------------
def selftest_reference() -> bool:
    """The float64 reference against a naive per-element formula and its gradients against central differences of
    L = sum(Y * dY); the bf16 rounding against hand-made cases."""
    ok = True
    # bf16 rounding: nearest, ties to even
    # (bf16 keeps 8 significant bits: the spacing just above 1 is 2^-7)
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, 1.0 + 2**-8 + 2**-20, -2.5, -(1.0 + 2**-7 + 2**-8)],
                 dtype=np.float32)
    want = np.array([1.0, 1.0, 1.0 + 2**-6, 1.0, 1.0 + 2**-7, -2.5, -(1.0 + 2**-6)], dtype=np.float32)
    got = bf16_round(x)
    good = bool(np.array_equal(got, want)) and bool(np.isnan(bf16_round(np.array([np.nan], np.float32)))[0])
    log(f"bf16 rounding: {'ok' if good else 'FAIL'} {got}")
    ok &= bool(good)

    rng = np.random.default_rng(1)
    B, T, H = 1, 6, 2
    C = H * HD
    qkv = rng.standard_normal((3, B, T, C)) * np.array([1.5, 1.5, 1.0])[:, None, None, None]
    dout = rng.standard_normal((B, T, C))
    ref = reference(qkv, dout, H)
    scale = 1.0 / math.sqrt(HD)

    # naive Y and lse
    err_y = err_l = 0.0
    for b in range(B):
        for h in range(H):
            cs = slice(h * HD, (h + 1) * HD)
            for i in range(T):
                s = np.array([qkv[0, b, i, cs] @ qkv[1, b, j, cs] * scale for j in range(i + 1)])
                lse = math.log(sum(math.exp(v) for v in s))
                p = np.exp(s - lse)
                yi = sum(p[j] * qkv[2, b, j, cs] for j in range(i + 1))
                err_y = max(err_y, float(np.abs(yi - ref["Y"][b, i, cs]).max()))
                err_l = max(err_l, abs(lse - ref["lse"][b, h, i]))
    good = err_y < 1e-12 and err_l < 1e-12
    log(f"reference Y, lse against the naive formula: max abs err {err_y:.2e}, {err_l:.2e} {'ok' if good else 'FAIL'}")
    ok &= good

    # D = rowsum(dY * Y) = rowsum(P * dP)
    q, k, v = (heads(qkv[i], H) for i in range(3))
    dy = heads(dout, H)
    s = q @ k.transpose(0, 1, 3, 2) * scale
    s[..., np.triu(np.ones((T, T), dtype=bool), 1)] = -np.inf
    p = np.exp(s - ref["lse"][..., None])
    d_alt = (p * (dy @ v.transpose(0, 1, 3, 2))).sum(-1)
    good = float(np.abs(d_alt - ref["D"]).max()) < 1e-12
    log(f"reference D = rowsum(P dP): {'ok' if good else 'FAIL'}")
    ok &= good

    # gradients against central differences, on a sample of entries of each plane
    def loss(x):
        return float((reference(x, dout, H)["Y"] * dout).sum())

    eps, worst = 1e-5, 0.0
    for plane in range(3):
        for _ in range(40):
            idx = (plane, 0, int(rng.integers(T)), int(rng.integers(C)))
            xp, xm = qkv.copy(), qkv.copy()
            xp[idx] += eps
            xm[idx] -= eps
            fd = (loss(xp) - loss(xm)) / (2 * eps)
            an = ref["dqkv"][idx]
            worst = max(worst, abs(fd - an) / max(1.0, abs(an)))
    good = worst < 1e-7
    log(f"reference dQ, dK, dV against central differences: worst {worst:.2e} {'ok' if good else 'FAIL'}")
    ok &= good

    # the comparison itself: exact outputs give zero errors, and a NaN fails
    inp = {"qkv": to_bf16_bits(qkv.astype(np.float32)), "dout": to_bf16_bits(dout.astype(np.float32))}
    inp["ref"] = reference(bf16_bits_to_f32(inp["qkv"]), bf16_bits_to_f32(inp["dout"]), H)
    inp["R"] = to_bf16_bits(np.zeros((3, B, T, C), np.float32))
    exact = {"Y": to_bf16_bits(inp["ref"]["Y"].astype(np.float32)), "lse": inp["ref"]["lse"].astype(np.float32),
             "dqkv": to_bf16_bits(inp["ref"]["dqkv"].astype(np.float32))}
    exact["D"] = (heads(bf16_bits_to_f32(inp["dout"]).astype(np.float64), H)
                  * heads(bf16_bits_to_f32(exact["Y"]).astype(np.float64), H)).sum(-1).astype(np.float32)
    r1 = compare(inp, exact, H)
    exact["lse"] = exact["lse"].copy()
    exact["lse"][0, 0, 0] = np.nan
    r2 = compare(inp, exact, H)
    good = r1["pass"] and max(r1["errors"].values()) < 5e-3 and not r2["pass"]
    log(f"compare(): exact outputs pass ({max(r1['errors'].values()):.1e}), a NaN fails: {'ok' if good else 'FAIL'}")
    ok &= good
    return bool(ok)


# ---- GPU ---------------------------------------------------------------------------------------------------------
def source_text(path: str | None) -> tuple[str, str]:
    """(label, text) of a kernel file with common.cuh spliced in, as andrea.ops.kernels_build.kernel_source() does;
    None: the repository's kernels/attn_bf16.cu."""
    if path is None:
        return "kernels/attn_bf16.cu", kernel_source("attn_bf16")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--source {path}: no such file")
    folder = kernel_dir()
    if file.resolve().parent == folder.resolve():
        return str(path), kernel_source(file.stem, folder)
    include = f'#include "{COMMON_HEADER}"'
    text = file.read_text()
    if include not in text:
        raise RuntimeError(f"--source {path}: no line {include}")
    header = (folder / COMMON_HEADER).read_text()
    spliced = f"// ---- {COMMON_HEADER} ----\n{header}// ---- end {COMMON_HEADER} ----"
    return str(path), text.replace(include, spliced, 1)


def launch_config(source: str, module=None, cp=None) -> dict:
    """The launch configuration: the module's attn_bf16_launch constant where it has one (it is what the compiler
    saw, variants included), else the kernel file's #defines."""
    v = module_ints(cp, module, LAUNCH_SYMBOL, 4) if module is not None else None
    if v:
        return {"threads": v[0], "rows": v[1], "kv_threads": v[2], "kv_rows": v[3]}

    def define(name):
        m = re.search(rf"#define {name} (\d+)", source)
        if not m:
            raise RuntimeError(f"kernels/attn_bf16.cu: no #define {name}")
        return int(m.group(1))
    return {"threads": define("ATTN_BF16_THREADS"), "rows": define("ATTN_BF16_ROWS"),
            "kv_threads": define("ATTN_BF16_KV_THREADS"), "kv_rows": define("ATTN_BF16_KV_ROWS")}


def hopper_module(cp, source: str, options: tuple[str, ...]):
    """The source built for sm_90a (the warpgroup products), as the engine builds it on Hopper: NVRTC to a cubin,
    loaded from a file."""
    import tempfile

    from andrea.ops.kernels_build import HOPPER_ARCH, compile_source

    cubin, _ = compile_source(source, "attn_bf16.cu", (f"-arch={HOPPER_ARCH}", "-std=c++17", *options))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    return cp.RawModule(path=f.name)


def module_ints(cp, module, symbol: str, n: int) -> list[int] | None:
    """The module's int[n] constant `symbol`, or None where it has none."""
    try:
        ptr = module.get_global(symbol)
    except Exception:  # noqa: BLE001 (a file without the constant)
        return None
    return [int(x) for x in cp.ndarray((n,), cp.int32, memptr=ptr).get()]


class Attn:
    def __init__(self, cp, source: str | None = None, options: tuple[str, ...] = (), hopper: bool = False):
        self.cp = cp
        source = kernel_source("attn_bf16") if source is None else source
        if hopper:
            self.mod = hopper_module(cp, source, options)
        else:
            self.mod = cp.RawModule(code=source, options=("-std=c++17", *options), backend="nvrtc")
        self.names = dict(zip(ROLES, HOPPER_KERNELS if hopper else KERNELS))
        self.ordered = "heads_first" in source  # an older file's kernels run the grid's own order only
        self.k = {role: self.mod.get_function(name) for role, name in self.names.items()}
        self.cfg = launch_config(source, self.mod, cp)
        # Hopper's dK / dV kernel takes dynamic shared memory, as much as the module's constant says (a file
        # without the constant: none)
        self.kv_smem = (module_ints(cp, self.mod, WG_KV_SMEM_SYMBOL, 1) or [0])[0] if hopper else 0
        if self.kv_smem:
            self.k["kv"].max_dynamic_shared_size_bytes = self.kv_smem
        # Static shared memory only (at most 48 KB a block): no attribute to set. The carveout as the engine sets it,
        # so that as many blocks share an SM as there.
        for f in self.k.values():
            f.preferred_shared_memory_carveout = CARVEOUT
        self.attrs = {role: {"kernel": self.names[role], "registers": int(f.num_regs),
                             "local_bytes": int(f.local_size_bytes), "static_shared_bytes": int(f.shared_size_bytes),
                             "max_threads_per_block": int(f.max_threads_per_block)} for role, f in self.k.items()}

    order_arg: int | None = None  # --heads-first; None: the engine's rule (andrea/ops/attn.py heads_first)

    def order(self, B, T, H) -> tuple:
        """(a grid of B H and `rows` a tile's, the kernels' last argument): the engine's launch_order; a file
        without the argument ignores it and runs the grid's own order (0)."""
        return launch_order(B * H, T, self.order_arg if self.ordered else 0)

    def fwd(self, out, lse, qkv, B, T, H):
        cfg, i32 = self.cfg, np.int32
        C = H * HD
        grid, first = self.order(B, T, H)
        self.k["fwd"](grid(cfg["rows"]), (cfg["threads"],), (out, lse, qkv, i32(B), i32(T), i32(C), i32(H),
                                                             np.float32(1 / math.sqrt(HD)), NO_AMAX, first))

    def bwd_dq(self, dqkv, delta, dout, y, qkv, lse, B, T, H):
        """The dQ kernel."""
        cfg, i32 = self.cfg, np.int32
        C, scale = H * HD, np.float32(1 / math.sqrt(HD))
        grid, first = self.order(B, T, H)
        self.k["dq"](grid(cfg["rows"]), (cfg["threads"],),
                     (dqkv, delta, dout, y, qkv, lse, i32(B), i32(T), i32(C), i32(H), scale, ADD, NO_AMAX,
                      *planes(B, T, C), first))

    def bwd_kv(self, dqkv, delta, dout, qkv, lse, B, T, H):
        """The dK/dV kernel."""
        cfg, i32 = self.cfg, np.int32
        C, scale = H * HD, np.float32(1 / math.sqrt(HD))
        grid, first = self.order(B, T, H)
        self.k["kv"](grid(cfg["kv_rows"]), (cfg["kv_threads"],),
                     (dqkv, delta, dout, qkv, lse, i32(B), i32(T), i32(C), i32(H), scale, ADD, NO_AMAX,
                      *planes(B, T, C), first),
                     shared_mem=self.kv_smem)

    def bwd(self, dqkv, delta, dout, y, qkv, lse, B, T, H):
        self.bwd_dq(dqkv, delta, dout, y, qkv, lse, B, T, H)
        self.bwd_kv(dqkv, delta, dout, qkv, lse, B, T, H)


def run_once(attn: Attn, dev: dict, B: int, T: int, H: int) -> dict:
    """fwd + bwd on device arrays, after poisoning the outputs and resetting dqkv to R; returns host copies."""
    cp = attn.cp
    dev["out"].fill(0xFFFF)  # bf16 NaN
    dev["lse"].fill(np.nan)
    dev["delta"].fill(np.nan)
    dev["dqkv"][...] = dev["R"]
    attn.fwd(dev["out"], dev["lse"], dev["qkv"], B, T, H)
    attn.bwd(dev["dqkv"], dev["delta"], dev["dout"], dev["out"], dev["qkv"], dev["lse"], B, T, H)
    cp.cuda.runtime.deviceSynchronize()
    return {"Y": cp.asnumpy(dev["out"]), "lse": cp.asnumpy(dev["lse"]), "D": cp.asnumpy(dev["delta"]),
            "dqkv": cp.asnumpy(dev["dqkv"])}


def device_arrays(cp, inp: dict, B: int, T: int, H: int) -> dict:
    C = H * HD
    return {"qkv": cp.asarray(inp["qkv"]), "dout": cp.asarray(inp["dout"]), "R": cp.asarray(inp["R"]),
            "out": cp.empty((B, T, C), dtype=cp.uint16), "lse": cp.empty((B, H, T), dtype=cp.float32),
            "delta": cp.empty((B, H, T), dtype=cp.float32), "dqkv": cp.empty((3, B, T, C), dtype=cp.uint16)}


def check_shapes(attn: Attn, inputs: dict | None = None) -> dict:
    """`inputs`: a cache of make_inputs() by shape, shared by the builds of one run."""
    res = {}
    inputs = {} if inputs is None else inputs
    for n, (B, T, H) in enumerate(SHAPES):
        name = f"B{B}_T{T}_H{H}"
        try:
            if name not in inputs:
                inputs[name] = make_inputs(B, T, H, seed=1000 + n)
            inp = inputs[name]
            dev = device_arrays(attn.cp, inp, B, T, H)
            got = run_once(attn, dev, B, T, H)
            r = compare(inp, got, H)
            again = run_once(attn, dev, B, T, H)
            r["deterministic"] = all(np.array_equal(got[k].view(np.uint8), again[k].view(np.uint8)) for k in got)
            bits = b"".join(np.ascontiguousarray(got[k]).tobytes() for k in sorted(got))
            r["digest"] = hashlib.sha1(bits).hexdigest()
            r["pass"] = r["pass"] and r["deterministic"]
        except Exception:  # noqa: BLE001 (reported, and the other sections still run)
            r = {"pass": False, "error": traceback.format_exc()}
        res[name] = r
        errs = " ".join(f"{k} {v:.2e}" for k, v in r.get("errors", {}).items())
        log(f"{name:>16}: {'ok  ' if r['pass'] else 'FAIL'} {errs} deterministic={r.get('deterministic')}"
            + (f"\n{r['error']}" if "error" in r else "")
            + (f" NaN={r['nan_count']}" if any(r.get("nan_count", {}).values()) else ""))
    return res


def bench_arrays(cp, B: int, T: int, H: int) -> dict:
    """The timing sections' device arrays of a shape: random bf16 qkv (Q and K of std QK_STD) and dY, the rest zero."""
    C = H * HD
    rng = np.random.default_rng(7)
    qkv = rng.standard_normal((3, B, T, C), dtype=np.float32)
    qkv[:2] *= QK_STD
    return {"qkv": cp.asarray(to_bf16_bits(qkv)),
            "dout": cp.asarray(to_bf16_bits(rng.standard_normal((B, T, C), dtype=np.float32))),
            "out": cp.zeros((B, T, C), dtype=cp.uint16), "lse": cp.zeros((B, H, T), dtype=cp.float32),
            "delta": cp.zeros((B, H, T), dtype=cp.float32), "dqkv": cp.zeros((3, B, T, C), dtype=cp.uint16)}


def bench(attn: Attn) -> dict:
    cp, res = attn.cp, {}
    for B, T, H in BENCH_SHAPES:
        name = f"B{B}_T{T}_H{H}"
        try:
            dev = bench_arrays(cp, B, T, H)

            def fwd_run(d=dev, s=(B, T, H)):
                attn.fwd(d["out"], d["lse"], d["qkv"], *s)

            def bwd_run(d=dev, s=(B, T, H)):
                attn.bwd(d["dqkv"], d["delta"], d["dout"], d["out"], d["qkv"], d["lse"], *s)

            def dq_run(d=dev, s=(B, T, H)):
                attn.bwd_dq(d["dqkv"], d["delta"], d["dout"], d["out"], d["qkv"], d["lse"], *s)

            def kv_run(d=dev, s=(B, T, H)):
                attn.bwd_kv(d["dqkv"], d["delta"], d["dout"], d["qkv"], d["lse"], *s)

            fwd_run()
            fwd, bwd = median_ms(fwd_run, REPEAT, WARMUP), median_ms(bwd_run, REPEAT, WARMUP)
            dq, kv = median_ms(dq_run, REPEAT, WARMUP), median_ms(kv_run, REPEAT, WARMUP)
            product = B * H * T * T * HD  # 2 B H T^2 hd / 2: one causal product
            r = {"fwd_ms": fwd, "bwd_ms": bwd, "bwd_dq_ms": dq, "bwd_kv_ms": kv,
                 "fwd_tflops": FWD_PRODUCTS * product / (fwd * 1e-3) / 1e12,
                 "bwd_tflops": BWD_PRODUCTS * product / (bwd * 1e-3) / 1e12}
            if (B, T, H) == (8, 1024, 12):
                r["fwd_target_met"] = fwd <= TARGET_MS["fwd"]
                r["bwd_target_met"] = bwd <= TARGET_MS["bwd"]
        except Exception:  # noqa: BLE001 (reported, and the other sections still run)
            r = {"error": traceback.format_exc()}
        res[name] = r
        log(f"{name:>16}: " + (f"fwd {r['fwd_ms']:.4f} ms ({r['fwd_tflops']:.0f} TFLOP/s), "
                               f"bwd {r['bwd_ms']:.4f} ms ({r['bwd_tflops']:.0f} TFLOP/s; alone: dq "
                               f"{r['bwd_dq_ms']:.4f} ms, kv {r['bwd_kv_ms']:.4f} ms)" if "error" not in r
                               else r["error"]))
    return res


def run_build(cp, source: str, options: tuple[str, ...], inputs: dict, hopper: bool = False) -> dict:
    """Builds one kernel source and runs every section on it; the report of that build."""
    rep: dict = {}
    ok = True
    try:
        attn = Attn(cp, source, options, hopper)
        rep["launch"] = attn.cfg
        rep["kernels"] = attn.attrs
        log(f"launch: {attn.cfg}")
        for name, a in attn.attrs.items():
            log(f"{name}: {a}")
            if a["local_bytes"]:
                log(f"  note: {name} uses {a['local_bytes']} bytes of local memory (register spills)")
    except Exception:  # noqa: BLE001 (reported)
        rep["build_error"] = traceback.format_exc()
        log(rep["build_error"])
        attn, ok = None, False

    if attn is not None:
        log("\n== correctness and determinism ==")
        rep["correctness"] = check_shapes(attn, inputs)
        ok &= all(r["pass"] for r in rep["correctness"].values())
        log("\n== timing ==")
        rep["timing"] = bench(attn)
        ok &= not any("error" in r for r in rep["timing"].values())
    rep["pass"] = bool(ok)
    return rep


def print_summary(rep: dict) -> None:
    log(f"{'shape':>16} {'Y':>9} {'lse':>9} {'D':>9} {'dQ':>9} {'dK':>9} {'dV':>9}  det   result")
    for name, r in rep.get("correctness", {}).items():
        e = r.get("errors", {})
        cells = " ".join(f"{e[k]:9.2e}" if k in e else f"{'-':>9}" for k in ("Y", "lse", "D", "dQ", "dK", "dV"))
        log(f"{name:>16} {cells}  {r.get('deterministic', '-')!s:5} {'ok' if r['pass'] else 'FAIL'}")
    log(f"{'limits':>16} " + " ".join(f"{LIMITS[k]:9.1e}" for k in ("Y", "lse", "D", "dQ", "dK", "dV")))
    for name, r in rep.get("timing", {}).items():
        if "error" not in r:
            log(f"{name:>16}  fwd {r['fwd_ms']:.4f} ms {r['fwd_tflops']:6.1f} TFLOP/s   "
                f"bwd {r['bwd_ms']:.4f} ms {r['bwd_tflops']:6.1f} TFLOP/s"
                + (f"   targets (fwd <= {TARGET_MS['fwd']} ms, bwd <= {TARGET_MS['bwd']} ms): "
                   f"{'met' if r['fwd_target_met'] else 'missed'} / {'met' if r['bwd_target_met'] else 'missed'}"
                   if "fwd_target_met" in r else ""))
    for name, a in rep.get("kernels", {}).items():
        log(f"{name:>20}: {a['registers']} registers, {a['local_bytes']} bytes local memory (spills), "
            f"{a['static_shared_bytes']} bytes static shared memory")


def print_comparison(builds: list[dict]) -> None:
    """One row per build: verdict, times (fwd, bwd and its two kernels alone) and TFLOP/s at each timed shape,
    registers (spill bytes) of fwd / dq / kv, the speed-up of fwd and bwd at the first timed shape over the first
    build, and a letter per distinct set of output bits over the checked shapes (same letter: identical outputs);
    "*" marks the fastest passing build by fwd + bwd at the first timed shape."""
    def total(b):
        r = b.get("timing", {}).get(BENCH_NAMES[0], {})
        return r["fwd_ms"] + r["bwd_ms"] if b["pass"] and "fwd_ms" in r else math.inf
    best = min(range(len(builds)), key=lambda i: total(builds[i]))
    best = best if math.isfinite(total(builds[best])) else -1
    width = max(len(b["label"]) for b in builds)
    head = f"{'build':<{width}}  result"
    for name in BENCH_NAMES:
        head += f" | {name}: fwd ms  bwd ms (dq + kv alone)    TFLOP/s f/b"
    head += f" | registers (spill bytes) fwd / dq / kv | vs {builds[0]['label']} at {BENCH_NAMES[0]} | bits"
    log(head)
    letters: dict = {}
    base = builds[0].get("timing", {}).get(BENCH_NAMES[0], {})
    for i, b in enumerate(builds):
        row = f"{b['label']:<{width}}  {'ok  ' if b['pass'] else 'FAIL'}  "
        for name in BENCH_NAMES:
            r = b.get("timing", {}).get(name, {})
            row += (f" | {r['fwd_ms']:7.4f} {r['bwd_ms']:7.4f} ({r['bwd_dq_ms']:.4f} + {r['bwd_kv_ms']:.4f}) "
                    f"{r['fwd_tflops']:5.0f}/{r['bwd_tflops']:<4.0f}" if "fwd_ms" in r else f" | {'-':<52}")
        k = b.get("kernels", {})
        row += " | " + " / ".join(f"{k[n]['registers']} ({k[n]['local_bytes']})" if n in k else "-" for n in ROLES)
        r = b.get("timing", {}).get(BENCH_NAMES[0], {})
        if "fwd_ms" in r and "fwd_ms" in base:
            row += f" | fwd x{base['fwd_ms'] / r['fwd_ms']:.2f}, bwd x{base['bwd_ms'] / r['bwd_ms']:.2f}"
        else:
            row += " | -"
        digest = tuple(c.get("digest") for c in b.get("correctness", {}).values())
        row += " | " + (letters.setdefault(digest, "ABCDEFGHIJ"[len(letters) % 10]) if digest and all(digest) else "-")
        log(row + ("  *" if i == best else ""))
    if best < 0:
        log("no build passes every check")


def shapes_arg(text: str) -> list[tuple[int, int, int]]:
    """--bench-shapes: BxTxH, comma-separated."""
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected shapes BxTxH, comma-separated "
                                         "(e.g. 8x1024x12,16x1024x32)")
    return shapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "results" / "attn_bf16_check"))
    ap.add_argument("--selftest-reference", action="store_true", help="check the float64 reference on the CPU and exit")
    ap.add_argument("--source", action="append", metavar="PATH",
                    help="kernel file to build and check (repeatable; default kernels/attn_bf16.cu)")
    ap.add_argument("--variants", metavar="LIST",
                    help="comma-separated ATTN_BF16_VARIANT values to build each source with that reads the macro")
    ap.add_argument("--bench-shapes", metavar="LIST", type=shapes_arg,
                    help="timed shapes BxTxH, comma-separated (default 8x1024x12,32x512x6; FlashAttention-3's "
                         "published benchmark at T 1024, head width 64, is 16x1024x32)")
    ap.add_argument("--heads-first", type=int, choices=(0, 1),
                    help="the kernels' launch order: 1 a head's tiles together, 0 a tile rank across every head "
                         "(default: 1 where every head's K and V pass L2), for a file that takes it")
    ap.add_argument("--hopper", action="store_true",
                    help="also build each source for sm_90a and check its warpgroup kernels (k_attn_*_wg)")
    ap.add_argument("--hopper-only", action="store_true",
                    help="as --hopper, without the builds of the mma kernels")
    args = ap.parse_args()
    Attn.order_arg = args.heads_first
    if args.bench_shapes:
        BENCH_SHAPES[:] = args.bench_shapes
        BENCH_NAMES[:] = [f"B{B}_T{T}_H{H}" for B, T, H in BENCH_SHAPES]
    if args.selftest_reference:
        ok = selftest_reference()
        log(f"reference self-test: {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1

    import cupy as cp

    # The builds: (label, source text, compile options), in order; the first is the baseline of the comparison.
    builds: list[dict] = []
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else []
    for path in args.source or [None]:
        label, text = source_text(path)
        if variants and "ATTN_BF16_VARIANT" in text:
            builds += [{"label": f"{label} [variant {v}]", "source": label, "variant": v, "text": text,
                        "options": (f"-DATTN_BF16_VARIANT={v}",)} for v in variants]
        else:
            if variants:
                log(f"note: {label} does not read ATTN_BF16_VARIANT; built once")
            builds.append({"label": label, "source": label, "variant": None, "text": text, "options": ()})
    if args.hopper or args.hopper_only:
        wg = [{**b, "label": f"{b['label']} [sm_90a wg]", "hopper": True} for b in builds]
        builds = wg if args.hopper_only else builds + wg

    report: dict = {"limits": LIMITS, "shapes": [list(s) for s in SHAPES]}
    ok = True
    try:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        report["device"] = {"name": name, "cc": f"{props['major']}.{props['minor']}",
                            "sms": props["multiProcessorCount"], "runtime": cp.cuda.runtime.runtimeGetVersion(),
                            "driver": cp.cuda.runtime.driverGetVersion()}
        log(f"device: {report['device']}")
    except Exception:  # noqa: BLE001 (reported)
        report["device_error"] = traceback.format_exc()
        log(report["device_error"])
        ok = False

    inputs: dict = {}  # make_inputs() by shape, shared by the builds
    for b in builds:
        if len(builds) > 1:
            log(f"\n==== {b['label']} ====")
        b.update(run_build(cp, b.pop("text"), b["options"], inputs, b.get("hopper", False)))
        ok &= b["pass"]
        if len(builds) > 1:
            log(f"\n== summary: {b['label']} ==")
            print_summary(b)
    if len(builds) == 1:
        b = builds[0]
        keys = ("launch", "kernels", "build_error", "correctness", "timing")
        report.update({k: v for k, v in b.items() if k in keys})
        log("\n== summary ==")
        print_summary(b)
    else:
        report["builds"] = builds
        log("\n== comparison ==")
        print_comparison(builds)
    report["pass"] = bool(ok)
    log(f"overall: {'PASS' if ok else 'FAIL'}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attn_bf16_check.json").write_text(json.dumps(report, indent=2, default=str))
    log(f"wrote {out / 'attn_bf16_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
