"""attn_fwd / attn_bwd: causal scaled dot-product attention.

NumPy saves the probabilities [B, H, T, T] in `att` (the plan's attention = "probs"). The CUDA half is
fused and saves the per-row logsumexp [B, H, T] instead ("lse"; `d_att` [B, H, T] then holds
rowsum(dY * Y)): kernels/attn.cu (TF32 products on widened tiles; 3xTF32 in fp32) at any head width up
to 64, and at head width 64 in the 16-bit builds kernels/attn_bf16.cu (the bf16 or f16 mma; on Hopper,
its sm_90a build's warpgroup products), whose launch shape is the module's constant attn_bf16_launch,
read when it loads."""

from __future__ import annotations

import functools
import math

import numpy as np

from andrea.common.errors import AndreaError
from andrea.ops.base import Draw, OpCase, kernel_defines, start_grad
from andrea.ops.fp8 import amax_arg, delayed_amax, fp8_halves, history_slot

KERNELS = {"attn": ("k_attn_fwd", "k_attn_bwd_dq", "k_attn_bwd"),
           "attn_bf16": ("k_attn_fwd_bf16", "k_attn_bwd_dq_bf16", "k_attn_bwd_bf16")}
# Beside them in the file's Hopper build (kernels_build.HOPPER_ARCH), the same three on the warpgroup products,
# with the same arguments and launch shape; the engine takes these where they are loaded.
# The last takes the dynamic shared memory its module's int constant WG_KV_SMEM_SYMBOL names.
HOPPER_KERNELS = {"attn_bf16": ("k_attn_fwd_wg", "k_attn_bwd_dq_wg", "k_attn_bwd_kv_wg")}
WG_KV_SMEM_SYMBOL = "attn_wg_kv_smem"
ATTN_BF16_HEAD = 64  # the only head width kernels/attn_bf16.cu takes
MMA16_KERNEL_FILE = "attn_bf16"  # built only for the precisions whose activations are 16-bit
MAX_GRID_Y = 65535  # a grid's second dimension at most: heads_first puts the heads there


def heads_first(heads: int, T: int, l2_bytes: int) -> bool:
    """The launch order of kernels/attn_bf16.cu for `heads` (B H) heads of T rows: each head's tiles together where
    every head's K and V (bf16) pass L2, so that a head's stay there while its blocks run (past L2 this is the
    faster order); else a tile rank across every head, the longest first, which balances the SMs better where
    everything fits (docs/PERFORMANCE.md, "Settings that change speed"). Either order gives the same bits."""
    return heads * 2 * T * ATTN_BF16_HEAD * 2 > l2_bytes and heads <= MAX_GRID_Y


@functools.cache
def _l2_bytes(device: int) -> int:
    import cupy

    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrL2CacheSize, device)


def launch_order(heads: int, T: int, first: int | None = None):
    """(the grid of a kernel of kernels/attn_bf16.cu by its tile's rows, its last argument) for `heads` (B H) heads
    of T rows: the order `first` asks (0 or 1), by default heads_first's on the current device."""
    if first is None:
        import cupy

        first = heads_first(heads, T, _l2_bytes(cupy.cuda.Device().id))

    def grid(rows: int) -> tuple[int, int]:
        tiles = -(-T // rows)
        return (tiles, heads) if first else (heads, tiles)

    return grid, np.int32(bool(first))


def engine_buffers() -> tuple:
    return ()


@functools.cache
def shared_memory() -> dict[str, int]:
    """Dynamic shared memory of kernels/attn.cu's kernels: Q, K, V tiles forward; Q, dY, K, V tiles and a
    query tile's lse and D backward."""
    k = kernel_defines("attn")
    tile = k["ATTN_TILE"] * k["ATTN_LD"] * 4
    return {"k_attn_fwd": 3 * tile, "k_attn_bwd_dq": 4 * tile + 2 * k["ATTN_TILE"] * 4,
            "k_attn_bwd": 4 * tile + 2 * k["ATTN_TILE"] * 4}


@functools.cache
def _future_mask(T):
    return np.triu(np.ones((T, T), dtype=bool), k=1)


def _heads(x, H):
    """[B, T, C] -> [B, H, T, C/H]"""
    B, T, C = x.shape
    return x.reshape(B, T, H, C // H).transpose(0, 2, 1, 3)


def _merge_heads(x):
    """[B, H, T, hd] -> [B, T, H*hd]"""
    B, H, T, hd = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * hd)


class NumpyOps:
    def attn_fwd(self, out, att, qkv, n_head):
        q, k, v = (_heads(qkv[i], n_head) for i in range(3))
        T = q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = self.mm(q, k.transpose(0, 1, 3, 2)) * scale
        s[..., _future_mask(T)] = -np.inf
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        att[...] = s
        out[...] = _merge_heads(self.mm(att, v))

    def attn_bwd(self, dqkv, datt, dout, qkv, out, att, n_head, overwrite=False, dqkv_history=None):
        """`out` is the forward's Y: rowsum(dP * P) = rowsum(dY * Y), since Y = P V and dP = dY V^T.
        `dqkv_history`: the layer's row of the dqkv history under fp8 rounding (a training pass's), into which dqkv's
        amax is folded (attn_qkv_bwd then rounds dqkv at the pass's scale)."""
        start_grad(dqkv, overwrite)
        q, k, v = (_heads(qkv[i], n_head) for i in range(3))
        scale = 1.0 / math.sqrt(q.shape[-1])
        dy = _heads(dout, n_head)
        self.mm(dy, v.transpose(0, 1, 3, 2), out=datt)
        # softmax backward: dS = P * (dP - rowsum(dY * Y)); masked entries have P = 0.
        ds = att * (datt - (dy * _heads(out, n_head)).sum(axis=-1)[..., None]) * scale
        dqkv[0] += _merge_heads(self.mm(ds, k))
        dqkv[1] += _merge_heads(self.mm(ds.transpose(0, 1, 3, 2), q))
        dqkv[2] += _merge_heads(self.mm(att.transpose(0, 1, 3, 2), dy))
        delayed_amax(dqkv_history, dqkv, True, "e5m2")


class CudaOps:
    def _attn_shape(self, qkv, n_head):
        k = kernel_defines("attn")
        _, B, T, C = qkv.shape
        hd = C // n_head
        if hd > k["ATTN_TILE"] or hd % 4:
            raise AndreaError(f"head width {hd} (d_model {C} / n_head {n_head}): the fused attention takes a "
                              f"multiple of 4 up to {k['ATTN_TILE']}")
        grid = (B * n_head, -(-T // k["ATTN_TILE"]))
        split = self.precision == "fp32"  # 3xTF32 products; tf32 takes one TF32 product
        return grid, (np.int32(B), np.int32(T), np.int32(C), np.int32(n_head), np.float32(1.0 / math.sqrt(hd)),
                      np.int32(split))

    def _bf16_attention(self, qkv, n_head) -> tuple | None:
        """Arguments of kernels/attn_bf16.cu when it takes this shape (16-bit build, head width 64), else None."""
        _, B, T, C = qkv.shape
        if "attn_bf16_launch" not in self.k or C != ATTN_BF16_HEAD * n_head:
            return None
        return B * n_head, T, (np.int32(B), np.int32(T), np.int32(C), np.int32(n_head),
                               np.float32(1.0 / math.sqrt(ATTN_BF16_HEAD)))

    def _bf16_kernels(self) -> tuple[str, str, str, int]:
        """The 16-bit attention's forward, dQ and dK/dV kernels, Hopper's own where the engine loaded them, and the
        dK/dV kernel's dynamic shared memory."""
        own = HOPPER_KERNELS[MMA16_KERNEL_FILE]
        if own[0] in self.k:
            return (*own, self.k[WG_KV_SMEM_SYMBOL])
        return (*KERNELS[MMA16_KERNEL_FILE], 0)

    def attn_fwd(self, out, att, qkv, n_head):
        self.fp8_book.wrote(out, att)
        bf16 = self._bf16_attention(qkv, n_head)
        if bf16:
            heads, T, dims = bf16
            threads, rows, _, _ = self.k["attn_bf16_launch"]
            grid, order = launch_order(heads, T)
            amax = amax_arg(None)  # no FP8 cast reads Y (attn_out's products stay bf16 under fp8)
            self.k[self._bf16_kernels()[0]](grid(rows), (threads,), (out, att, qkv, *dims, amax, order))
            return
        grid, dims = self._attn_shape(qkv, n_head)
        self.k["k_attn_fwd"](grid, (kernel_defines("attn")["ATTN_THREADS"],), (out, att, qkv, *dims),
                             shared_mem=shared_memory()["k_attn_fwd"])

    def attn_bwd(self, dqkv, datt, dout, qkv, out, att, n_head, overwrite=False, dqkv_history=None):
        """`dqkv_history` (a training pass under fp8): where the model's rows of dqkv go to FP8 products, dqkv is
        written as E5M2 bytes only, at the history's scale (_dqkv_e5m2)."""
        self.fp8_book.wrote(dqkv, datt)
        add = np.int32(not overwrite)
        ld, plane = (np.int32(n) for n in grad_rows(dqkv))
        bf16 = self._bf16_attention(qkv, n_head)
        if bf16:
            heads, T, dims = bf16
            threads, rows, kv_threads, kv_rows = self.k["attn_bf16_launch"]
            _, dq, kv, kv_smem = self._bf16_kernels()
            e5m2 = self._dqkv_e5m2(dqkv, dqkv_history, overwrite)
            if e5m2 is not None:  # the bytes, the scale, the amax word (the history's)
                q8, scale, amax = e5m2[0], history_slot(dqkv_history, "SCALE"), history_slot(dqkv_history, "AMAX")
            else:  # both kernels' stores' amax, one word; null outside an fp8 pass
                q8, scale, amax = np.uint64(0), np.uint64(0), amax_arg(self.fp8_book.produced(dqkv))
            grid, order = launch_order(heads, T)
            self.k[dq](grid(rows), (threads,),
                       (dqkv, datt, dout, out, qkv, att, *dims, add, amax, ld, plane, q8, scale, order))
            self.k[kv](grid(kv_rows), (kv_threads,),
                       (dqkv, datt, dout, qkv, att, *dims, add, amax, ld, plane, q8, scale, order),
                       shared_mem=kv_smem)
            if e5m2 is not None:
                self._dqkv_e5m2_done(dqkv, dqkv_history, *e5m2,
                                     rerun=lambda: self.attn_bwd(dqkv, datt, dout, qkv, out, att, n_head, overwrite))
            return
        grid, dims = self._attn_shape(qkv, n_head)
        threads, smem = (kernel_defines("attn")["ATTN_THREADS"],), shared_memory()
        # The first writes D = rowsum(dY * Y) into datt and adds dQ; the second reads D and adds dK, dV.
        self.k["k_attn_bwd_dq"](grid, threads, (dqkv, datt, dout, out, qkv, att, *dims, add, ld, plane),
                                shared_mem=smem["k_attn_bwd_dq"])
        self.k["k_attn_bwd"](grid, threads, (dqkv, datt, dout, qkv, att, *dims, add, ld, plane),
                             shared_mem=smem["k_attn_bwd"])

    def _dqkv_e5m2(self, dqkv, row, overwrite: bool):
        """(X, X^T): the halves of the bytes of the model's rows of dqkv [N, 3C] (ops/fp8.py fp8_halves) that the
        attention backward writes as E5M2, at the dqkv history's scale, where it takes that path: a row given (a
        training pass whose backward follows, under fp8), dqkv written over (not added into), laid out as rows, and
        FP8 products for attn_qkv_bwd's shapes; else None (dqkv in bf16)."""
        if row is None or not overwrite or self.blas_lt is None or not self.fp8_book.in_pass:
            return None
        C = dqkv.shape[-1]
        N = dqkv[0].size // C
        if grad_rows(dqkv) != (3 * C, C) or not self.fp8_book.ok(N, C):
            return None
        return fp8_halves(self.xp.moveaxis(dqkv, 0, -2).reshape(N, 3 * C))

    def _dqkv_e5m2_done(self, dqkv, row, q, qt, rerun) -> None:
        """After the kernels wrote dqkv's E5M2 bytes q: its transpose qt [3C, N] (dW_QKV's operand), the pass folded
        into the row, and the bytes kept for attn_qkv_bwd at this pass's descale; `rerun()` writes dqkv in bf16
        instead, for a product that reads it so (Fp8Book.readable)."""
        C = dqkv.shape[-1]
        self.fp8_book.history_transpose(q, qt, dqkv[0].size // C, 3 * C, row, "e5m2")
        self.fp8_book.bytes_written(dqkv, q, qt, history_slot(row, "DESCALE_NOW"), rerun, "e5m2")


def grad_rows(dqkv) -> tuple[int, int]:
    """(row stride, plane stride) of a [3, B, T, C] gradient in elements: (C, B T C) when it is contiguous, (3 C, C)
    when it is a view of rows [B, T, 3, C] (the model's d_qkv, which attn_qkv_bwd reads as one [B T, 3 C] matrix).
    B and T may be one axis of B T rows."""
    C, N = dqkv.shape[-1], dqkv[0].size // dqkv.shape[-1]
    st = [s // dqkv.itemsize for s in dqkv.strides]
    plane, t = st[0], st[-2]
    rows = st[-1] == 1 and all(st[i] == st[i + 1] * dqkv.shape[i + 1] for i in range(1, dqkv.ndim - 2))
    if not rows or (t, plane) not in ((C, N * C), (3 * C, C)):
        raise AndreaError(f"dqkv {dqkv.shape} with strides {dqkv.strides}: attn_bwd and attn_qkv_bwd take [3, B, T, C] "
                          f"contiguous or as a view of rows [B, T, 3, C]")
    return t, plane


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    """What the fused kernels compute: products over the causal half of T x T (one such product is
    B T^2 C FLOPs), 2 forward and 7 backward (see kernels/attn.cu), no T x T bytes."""
    N, A, S = B * T, B * H * T * T // 2, B * H * T
    return {"attn_fwd": (2 * B * T * T * C + 5 * A, f * (4 * N * C + S)),
            "attn_bwd": (7 * B * T * T * C + 8 * A, f * (11 * N * C + 3 * S))}[call]


def attention_lse(qkv, n_head: int) -> np.ndarray:
    """Per-row logsumexp of the causal scaled scores, [B, H, T], in float64: what a fused attention saves."""
    _, B, T, C = qkv.shape
    hd = C // n_head
    q, k = (np.asarray(qkv[i], dtype=np.float64).reshape(B, T, n_head, hd).transpose(0, 2, 1, 3) for i in (0, 1))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    s[..., np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
    top = s.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(s - top).sum(axis=-1, keepdims=True)))[..., 0]


CASES = ("attn", "attn_rows")
OVERWRITE_CASES = CASES


def case(name: str, s, draw: Draw) -> OpCase:
    """attn_rows: dqkv as the model lays it out, a view of rows [B, T, 3, C] (grad_rows)."""
    B, T, C, H = s.B, s.T, s.C, s.H
    rows = name == "attn_rows"
    a = {"qkv": draw.randn(3, B, T, C), "out": draw.nan(B, T, C), "att": draw.nan(B, H, T, T),
         "dqkv": draw.grad(B, T, 3, C) if rows else draw.grad(3, B, T, C), "datt": draw.nan(B, H, T, T),
         "dout": draw.randn(B, T, C)}

    def run(E, x):
        E.attn_fwd(x["out"], x["att"], x["qkv"], H)
        dqkv = x["dqkv"].transpose(2, 0, 1, 3) if rows else x["dqkv"]
        E.attn_bwd(dqkv, x["datt"], x["dout"], x["qkv"], x["out"], x["att"], H, overwrite=draw.overwrite)

    # datt is scratch: its contents are the engine's
    return OpCase(a, run, ("out", "att", "dqkv"), lse_arrays={"att": draw.nan(B, H, T), "datt": draw.nan(B, H, T)},
                  lse_reference=lambda x: {"att": attention_lse(x["qkv"], H)}, act=("qkv", "out", "dqkv", "dout"))
