"""attn_qkv_fwd / attn_qkv_bwd: the Q, K and V projections, qkv[i] = inp @ W_QKV[i]. cuBLAS products. W_QKV is the
layer's W_Q, W_K, W_V, which the parameter layout stores back to back: one [3, C, C] view, so the CUDA half runs the
forward and the weight gradient as batched products. Its input gradient over the model's dqkv, whose rows hold a
token's dQ, dK, dV side by side, is one product over 3C with a [C, 3C] copy of W_QKV (kernels/attn_qkv.cu's
k_qkv_rows, kept current by prepare_qkv_rows)."""

from __future__ import annotations

import numpy as np

from andrea.spec.memory import BufferSpec
from andrea.ops.attn import grad_rows
from andrea.ops.base import Draw, OpCase, blocks, start_grad
from andrea.ops.fp8 import delayed_amax

KERNELS = {"attn_qkv": ("k_qkv_rows",)}
QKV_ROWS_THREADS = 256  # k_qkv_rows: a warp a row, any multiple of 32


def engine_buffers() -> tuple:
    return ()


class NumpyOps:
    """`fp8_operand` is what each product reads: the array itself, or in the fp8 emulation its FP8 rounding
    (engines/fp8_emulation.py), one scale per tensor as the CUDA fp8 path casts it. `dqkv_history`: the layer's row
    of the dqkv history (a training pass's, under fp8 rounding), at whose scale for this pass dqkv is rounded (its
    attn_bwd folded it)."""

    def attn_qkv_fwd(self, qkv, inp, W_QKV):
        x, W = self.fp8_operand(inp, "e4m3"), self.fp8_operand(W_QKV, "e4m3")
        for i in range(3):
            self.mm(x, W[i], out=qkv[i])

    def attn_qkv_bwd(self, dinp, dW_QKV, dqkv, inp, W_QKV, overwrite=False, overwrite_weights=False,
                     dqkv_history=None):
        start_grad(dinp, overwrite)
        start_grad(dW_QKV, overwrite_weights)
        C = inp.shape[-1]
        x2 = self.fp8_operand(inp, "e4m3").reshape(-1, C)
        dq = self.fp8_operand(dqkv, "e5m2", delayed_amax(dqkv_history, dqkv, False, "e5m2"))
        W = self.fp8_operand(W_QKV, "e4m3")
        for i in range(3):
            dW_QKV[i] += self.mm(x2.T, dq[i].reshape(-1, C))
            dinp += self.mm(dq[i], W[i].T)


class CudaOps:
    def attn_qkv_fwd(self, qkv, inp, W_QKV):
        C = inp.shape[-1]
        N = inp.size // C
        book = self.fp8_book
        book.wrote(qkv)
        if not (book.ok(N, C) and self._attn_qkv_fwd_fp8(qkv, inp, W_QKV, N, C)):
            book.readable(inp)
            self.blas.gemm(qkv, inp, W_QKV, N, C, C, batch=3, stride_b=C * C, stride_c=N * C)

    def _attn_qkv_fwd_fp8(self, qkv, inp, W_QKV, N, C) -> bool:
        """qkv[i] = X @ W_i on FP8 operands: X [N, C] and each W_i^T [C, C], one batched product (False: not run);
        X^T kept for the backward's dW_QKV (Fp8Book.cast_saving)."""
        book = self.fp8_book
        xq, wt = book.operands(N * C, 3 * C * C)
        xq, sx = book.cast_saving(inp, N, C, xq, True)
        wt, sw = book.weight(W_QKV, "forward", C, C, 1, into=wt, qt_batch=C * C, batch=3)
        return book.gemm(qkv, xq, sx, "e4m3", wt, sw, "e4m3", N, C, C, batch=3, stride_b=C * C, stride_c=N * C,
                         fast=True)

    def prepare_qkv_rows(self, w_qkv_rows, layers) -> None:
        """Copy each layer's W_QKV of `layers` (the model's weight views) into w_qkv_rows [L, C, 3C] as W_Q, W_K, W_V
        side by side (kernels/attn_qkv.cu): attn_qkv_bwd's input gradient over rows of dqkv is then one product
        over 3C. The model calls this whenever it writes its weights (load, every AdamW step); the engine keeps the
        last model's views. One launch: the parameter layout puts the layers' W_QKV evenly apart."""
        Ws = [w["W_QKV"] for w in layers]
        L, C = len(Ws), Ws[0].shape[-1]
        layer = (Ws[1].data.ptr - Ws[0].data.ptr) // Ws[0].itemsize if L > 1 else 0
        self.launch("k_qkv_rows", blocks(3 * L * C, QKV_ROWS_THREADS // 32), QKV_ROWS_THREADS, w_qkv_rows, Ws[0],
                    np.int64(layer), np.int32(L), np.int32(C))
        self._qkv_rows = {W.data.ptr: (W, w_qkv_rows[l]) for l, W in enumerate(Ws)}

    def attn_qkv_bwd(self, dinp, dW_QKV, dqkv, inp, W_QKV, overwrite=False, overwrite_weights=False,
                     dqkv_history=None):
        """`dqkv_history`: unread here; where attn_bwd wrote dqkv as E5M2 bytes at its scale, the products take those
        bytes (or, any product reading it in bf16, attn_bwd runs again: Fp8Book.readable)."""
        C = inp.shape[-1]
        N = inp.size // C
        book = self.fp8_book
        book.wrote(dinp)
        ld, plane = grad_rows(dqkv)
        rows = self.xp.moveaxis(dqkv, 0, -2).reshape(N, 3 * C) if plane == C else None  # [dQ dK dV] a row
        beta_w = 0.0 if overwrite_weights else 1.0
        done_dW, done_dinp = (self._attn_qkv_bwd_fp8(dinp, dW_QKV, dqkv, rows, inp, W_QKV, overwrite, beta_w, N, C)
                              if book.ok(N, C) else (False, False))
        if not done_dW:  # the three C x C weight gradients as one batched product
            book.readable(inp, dqkv)
            self.blas.gemm(dW_QKV, inp, dqkv, C, C, N, trans_a=True, ldb=ld, beta=beta_w, batch=3, stride_b=plane,
                           stride_c=C * C)
        if done_dinp:
            return
        book.readable(dqkv)
        copy = self._qkv_rows.get(W_QKV.data.ptr) if rows is not None else None
        if copy is not None and copy[0].shape == W_QKV.shape:  # dinp = [dQ dK dV] @ [W_Q W_K W_V]^T, over 3C
            self.blas.gemm(dinp, rows, copy[1], N, C, 3 * C, trans_b=True, beta=0.0 if overwrite else 1.0)
            return
        for i in range(3):
            self.blas.gemm(dinp, dqkv[i], W_QKV[i], N, C, C, trans_b=True, lda=ld,
                           beta=0.0 if overwrite and i == 0 else 1.0)

    def _attn_qkv_bwd_fp8(self, dinp, dW_QKV, dqkv, rows, inp, W_QKV, overwrite, beta_w, N, C) -> tuple[bool, bool]:
        """dW_i = X^T dq_i + beta_w dW_i (X^T [C, N] and each dq_i^T [C, N]: one batched product), and dinp =
        [dq_0 dq_1 dq_2] @ [W_0; W_1; W_2]^T as one product over 3C (dqkv cast as [N, 3C], W_QKV as [C, 3C]).
        `rows`: dqkv as that [N, 3C] matrix where it is laid out so (else its planes are cast side by side). Which
        of the two ran."""
        book = self.fp8_book
        xt, dqt, dq, w = book.operands(N * C, 3 * N * C, 3 * N * C, 3 * C * C)
        xt, sx = book.transpose(inp, N, C, xt)
        written = book.bytes_of(dqkv, "e5m2")
        if written is not None:  # attn_bwd's bytes: [N, 3C] and its transpose (ops/attn.py)
            (dq, sd), (dqt, _) = written, book.saved_transpose(dqkv)
        elif rows is not None:  # its transpose [3C, N] is dq_i^T [C, N] after one another
            sd = book.cast(rows, N, 3 * C, "e5m2", 1, q=dq, qt=dqt)
        else:
            sd = book.cast(dqkv, N, C, "e5m2", 1, q=dq, ldq=3 * C, q_batch=C, qt=dqt, qt_batch=C * N, batch=3)
        w, sw = book.weight(W_QKV, "input_grad", C, C, 2, into=w, ldq=3 * C, q_batch=C, batch=3)
        return (book.gemm(dW_QKV, xt, sx, "e4m3", dqt, sd, "e5m2", C, C, N, beta=beta_w, batch=3, stride_b=C * N,
                          stride_c=C * C),
                book.gemm(dinp, dq, sd, "e5m2", w, sw, "e4m3", N, C, 3 * C, beta=0.0 if overwrite else 1.0))


def plan_buffers(C: int, L: int, dtype: str) -> tuple:
    """What a training model's plan adds where the engine's attn_qkv_bwd reads W_QKV as [C, 3C] (its trait
    qkv_weight_rows): each layer's copy, kept current through prepare_qkv_rows."""
    return (BufferSpec("w_qkv_rows", (L, C, 3 * C), dtype, "parameters"),)


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    N = B * T
    return {"attn_qkv_fwd": (6 * N * C * C, f * (4 * N * C + 3 * C * C)),
            "attn_qkv_bwd": (12 * N * C * C, f * (6 * N * C + 9 * C * C))}[call]


CASES = ("attn_qkv", "attn_qkv_rows")
OVERWRITE_CASES = CASES


def case(name: str, s, draw: Draw) -> OpCase:
    """attn_qkv_rows: dqkv as the model lays it out, a view of rows [B, T, 3, C], with W_QKV's [C, 3C] copy
    prepared where the engine keeps one (the model's path)."""
    B, T, C = s.B, s.T, s.C
    w = C**-0.5
    rows = name == "attn_qkv_rows"
    a = {"inp": draw.randn(B, T, C), "W_QKV": draw.randn(3, C, C, scale=w), "qkv": draw.nan(3, B, T, C),
         "dinp": draw.grad(B, T, C), "dW_QKV": draw.grad(3, C, C),
         "dqkv": draw.randn(B, T, 3, C) if rows else draw.randn(3, B, T, C), "w_qkv_rows": draw.nan(1, C, 3 * C)}

    def run(E, x):
        E.attn_qkv_fwd(x["qkv"], x["inp"], x["W_QKV"])
        if rows and E.traits.qkv_weight_rows:
            E.prepare_qkv_rows(x["w_qkv_rows"], [{"W_QKV": x["W_QKV"]}])
        dqkv = x["dqkv"].transpose(2, 0, 1, 3) if rows else x["dqkv"]
        E.attn_qkv_bwd(x["dinp"], x["dW_QKV"], dqkv, x["inp"], x["W_QKV"], overwrite=draw.overwrite,
                       overwrite_weights=draw.overwrite)

    return OpCase(a, run, ("qkv", "dinp", "dW_QKV"), act=("inp", "W_QKV", "qkv", "dqkv", "w_qkv_rows", "dinp"))
