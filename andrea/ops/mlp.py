"""mlp_fwd / mlp_bwd: W_1, GELU (the tanh approximation), W_2 (kernels/mlp.cu: the GELU passes). In the
16-bit builds GELU and its gradient are epilogues of the products (cuBLASLt GELU_AUX / DGELU) where
cuBLASLt has an algorithm for the shape, else the product and the kernel pass."""

from __future__ import annotations

import math

import numpy as np

from andrea.ops.fp8 import (AMAX_BLOCKS, DPRE_SLOT, amax_arg, delayed_amax, descale, dgelu_amax, dgelu_factor,
                            fp8_halves, history_slot)
from andrea.ops.base import ELEMENTWISE_THREADS, Draw, OpCase, kernel_defines, overlaps, ptr, start_grad

KERNELS = {"mlp": ("k_mlp_fwd", "k_mlp_bwd")}
GELU_K = math.sqrt(2.0 / math.pi)


def engine_buffers() -> tuple:
    return ()


def _gelu(x):
    # x * x * x, not x**3: NumPy's float32 pow is far slower than two multiplies.
    return 0.5 * x * (1.0 + np.tanh(GELU_K * (x + 0.044715 * (x * x * x))))


def _gelu_grad(x):
    th = np.tanh(GELU_K * (x + 0.044715 * (x * x * x)))
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_K * (1.0 + 3 * 0.044715 * x * x)


class NumpyOps:
    """`fp8_operand`: as in attn_qkv (E4M3 activations and weights, E5M2 gradients). `act_history`: the layer's
    row of the act history under fp8 rounding (ops/fp8.py; a training pass's), whose scale act is rounded at
    instead of its own amax's, and into which the forward folds act's amax."""

    def mlp_fwd(self, out, pre, act, inp, W_1, W_2, recompute=False, act_history=None):
        """With `recompute`, pre need not be kept (the backward rebuilds it); here it is written anyway."""
        q = self.fp8_operand
        self._mlp_up(pre, act, inp, W_1)
        self.mm(q(act, "e4m3", delayed_amax(act_history, act, True, "e4m3")), q(W_2, "e4m3"), out=out)

    def _mlp_up(self, pre, act, inp, W_1):
        q = self.fp8_operand
        self.mm(q(inp, "e4m3"), q(W_1, "e4m3"), out=pre)
        act[...] = _gelu(pre)

    def mlp_bwd(self, dinp, dW_1, dW_2, dpre, dout, inp, pre, act, W_1, W_2, recompute=False, overwrite=False,
                keep_dpre=True, overwrite_weights=False, act_history=None):
        """With `recompute`, pre and act are stale (buffers shared by the layers) and are first rebuilt from inp.
        `keep_dpre`: as CudaOps' (here dpre is always written)."""
        start_grad(dinp, overwrite)
        start_grad(dW_1, overwrite_weights)
        start_grad(dW_2, overwrite_weights)
        C, F = W_1.shape
        q = self.fp8_operand
        if recompute:
            self._mlp_up(pre, act, inp, W_1)
        d = q(dout, "e5m2")
        a = q(act, "e4m3", delayed_amax(act_history, act, False, "e4m3"))
        dW_2 += self.mm(a.reshape(-1, F).T, d.reshape(-1, C))
        self.mm(d, q(W_2, "e4m3").T, out=dpre)
        dpre *= _gelu_grad(pre)
        # the CUDA cast's scale: a bound of |dpre| from the operands' scales (dgelu_amax); q is the identity
        # (d is dout) outside the fp8 emulation
        bound = None if d is dout else dgelu_amax(C, descale(dout, "e5m2"), descale(W_2, "e4m3"))
        dp = q(dpre, "e5m2", bound)
        dW_1 += self.mm(q(inp, "e4m3").reshape(-1, C).T, dp.reshape(-1, F))
        dinp += self.mm(dp, q(W_1, "e4m3").T)


class CudaOps:
    def mlp_fwd(self, out, pre, act, inp, W_1, W_2, recompute=False, act_history=None):
        """With `recompute` (the backward rebuilds pre), act alone where the product can write it alone.
        `act_history` (a training pass under fp8): act in E4M3 at the history's scale (_mlp_up_delayed)."""
        C, F = W_1.shape
        N = inp.size // C
        book = self.fp8_book
        if self._act_delayed(act_history, N, C) and self._mlp_up_delayed(pre, act, inp, W_1, act_history, fold=True,
                                                                          transpose=not recompute):
            book.wrote(out)
            q, _ = fp8_halves(act)
            if not book.times_weight(out, q, history_slot(act_history, "DESCALE_NOW"), W_2, N, F, C,
                                     into=book.operands(F * C)[0]):
                raise RuntimeError(f"mlp_fwd: no FP8 algorithm for act @ W_2 ({N} x {F} x {C}) after act was written "
                                   "in E4M3")
            return
        if not (recompute and self._gelu_alone(pre, act, inp, W_1)):
            self._mlp_up(pre, act, inp, W_1, save_transpose=True)
        book.wrote(out)
        # act^T on FP8 kept for the backward's dW_2 where act itself is (not rebuilt there)
        self.linear_fwd(out, act, W_2, N, F, C, save_transpose=not recompute)

    def _mlp_up(self, pre, act, inp, W_1, save_transpose: bool = False):
        """pre = inp @ W_1 and act = GELU(pre): one cuBLASLt product where the build has it, else two passes.
        `save_transpose` (the forward's): on FP8 operands inp^T kept for the backward's dW_1."""
        if not self._gelu_epilogue(pre, act, inp, W_1, save_transpose):
            C, F = W_1.shape
            self.linear_fwd(pre, inp, W_1, inp.size // C, C, F, save_transpose=save_transpose)
            self._gelu(act, pre)

    def _act_delayed(self, act_history, N: int, C: int) -> bool:
        """Whether act goes through the delayed path: a history row given, FP8 products for the shape, cuBLASLt, and a
        pass whose backward reads what the forward saves."""
        book = self.fp8_book
        return (act_history is not None and self.blas_lt is not None and book.ok(N, C) and book.in_pass
                and book.backward_follows())

    def _mlp_up_delayed(self, pre, act, inp, W_1, row, fold: bool, transpose: bool) -> bool:
        """pre = inp @ W_1 (bf16, GELU_AUX's aux) and act = GELU(pre) written by the product itself in E4M3, into the
        first half of act's own bytes, at the scale of `row` (ops/fp8.py, the act history: the next pass's where
        `fold`, the forward's; this pass's, a recompute's); then, `transpose`, act^T into the second half (dW_2's
        operand, kept for the backward with this pass's descale), and with `fold` the pass folded into the row.
        False where cuBLASLt has no algorithm for the product (nothing written)."""
        C, F = W_1.shape
        N = inp.size // C
        q, qt = fp8_halves(act)
        book = self.fp8_book
        book.wrote(pre, act)
        # the forward keeps inp^T for dW_1
        if not book.linear_fwd(q, inp, W_1, N, C, F, save_transpose=fold, epilogue="gelu_aux", aux=pre,
                               d_type="e4m3", d_scale=history_slot(row, "SCALE" if fold else "SCALE_NOW"),
                               amax_d=history_slot(row, "AMAX")):
            return False
        qt = qt if transpose else None
        book.history_transpose(q, qt, N, F, row, "e4m3" if fold else None)
        # act is E4M3 bytes only: a bf16 reader has GELU(pre) rewrite it first (Fp8Book.readable)
        book.bytes_written(act, q, qt, history_slot(row, "DESCALE_NOW"), lambda: self._gelu(act, pre), "e4m3")
        return True

    def _gelu_epilogue(self, pre, act, inp, W_1, save_transpose: bool = False) -> bool:
        """pre = inp @ W_1 and act = GELU(pre) as one cuBLASLt product (GELU_AUX); False where there is none."""
        book = self.fp8_book
        book.wrote(pre, act)  # the product writes both without their amax (act's cast finds it)
        C, F = W_1.shape
        N = inp.size // C
        if self.blas_lt is None:
            return False
        if book.ok(N, C):
            return book.linear_fwd(act, inp, W_1, N, C, F, save_transpose=save_transpose, epilogue="gelu_aux", aux=pre)
        book.readable(inp)  # a LayerNorm's output written as E4M3 bytes only: its bf16 values first
        return self.blas_lt.gemm(act, inp, W_1, N, F, C, epilogue="gelu_aux", aux=pre)

    def _gelu_alone(self, pre, act, inp, W_1) -> bool:
        """act = GELU(inp @ W_1) with _mlp_up's bits, pre left unwritten: cuBLASLt's GELU epilogue on the algorithm
        of GELU_AUX (the CublasLt plan of "gelu"), half GELU_AUX's bytes. False where there is none (no cuBLASLt,
        FP8 operands, or an algorithm that cannot leave out aux)."""
        C, F = W_1.shape
        N = inp.size // C
        book = self.fp8_book
        if self.blas_lt is None or book.ok(N, C):
            return False
        book.wrote(act)
        book.readable(inp)
        return self.blas_lt.gemm(act, inp, W_1, N, F, C, epilogue="gelu", aux=pre)

    def _gelu(self, act, pre):
        self._gelu_pass("k_mlp_fwd", act, pre)

    def _gelu_grad(self, dpre, pre):
        """dpre *= GELU'(pre), in place."""
        self._gelu_pass("k_mlp_bwd", dpre, pre)

    def _gelu_pass(self, kernel: str, out, pre):
        """One of the GELU kernels over pre into out; in an fp8 pass with out's amax, on fewer blocks (each ends
        with one atomic on the amax word)."""
        amax = self.fp8_book.produced(out)
        grid = self.vec_blocks(pre.size)
        if amax is not None:
            grid = min(grid, AMAX_BLOCKS)
        self.launch(kernel, grid, ELEMENTWISE_THREADS, out, pre, np.int64(pre.size), amax_arg(amax))

    def mlp_bwd(self, dinp, dW_1, dW_2, dpre, dout, inp, pre, act, W_1, W_2, recompute=False, overwrite=False,
                keep_dpre=True, overwrite_weights=False, act_history=None):
        """With `recompute`, pre and act are stale (buffers shared by the layers) and are first rebuilt with the
        forward's bits by its product. `keep_dpre` False (the model's backward, which reads dpre no more): on FP8
        operands dpre may be left holding dout @ W_2^T, the gradient at pre going to the products as E5M2 only (a
        write of dpre less); the other outputs' bits are the same either way. `act_history`: the forward's (act as
        E4M3 bytes, its transpose kept or rebuilt at this pass's scale). A forward that wrote act as E4M3 bytes
        before a backward that reads it in bf16 (no history given, FP8 products off): act = GELU(pre) again first."""
        C, F = W_1.shape
        N = inp.size // C
        book = self.fp8_book
        book.wrote(dinp, dpre)
        delayed = self._act_delayed(act_history, N, C)
        if recompute:
            delayed = delayed and self._mlp_up_delayed(pre, act, inp, W_1, act_history, fold=False, transpose=True)
            if not delayed:
                self._mlp_up(pre, act, inp, W_1)
        elif not delayed:  # FP8 products off inside the pass, or no history: a forward's E4M3 act is rebuilt in bf16
            book.readable(act)
        # whether act holds this pass's E4M3 bytes (else the forward took the plain path: no algorithm)
        delayed = delayed and book.bytes_of(act, "e4m3") is not None
        if delayed and book.saved_transpose(act) is None:
            raise RuntimeError("mlp_bwd: act's E4M3 transpose of this pass is gone (act_history given to the backward "
                               "of a forward that did not write it)")
        # dW_2 += act^T @ dout, dpre = (dout @ W_2^T) * GELU'(pre); on FP8 operands the product, then the kernel:
        # (cuBLASLt's DGELU epilogue on FP8 operands is slower than the two: docs/PERFORMANCE.md, "Tried and not taken")
        beta_w = 0.0 if overwrite_weights else 1.0
        done_dW, done_dpre, sd, sw = (book.linear_bwd(dpre, dW_2, dout, act, W_2, N, F, C, 0.0, beta_w=beta_w)
                                      if book.ok(N, C) else (False, False, None, None))
        if not done_dW:
            # a recomputed layer's dpre is act's buffer (model.py), written over by the product just now
            if done_dpre and overlaps(ptr(dpre), dpre.nbytes, ptr(act), act.nbytes):
                raise RuntimeError(f"mlp_bwd: no FP8 algorithm for dW_2 ({F} x {C} x {N}) but one for dpre, which "
                                   "shares act's buffer and was written first")
            book.readable(act)
            self.blas.gemm(dW_2, act, dout, F, C, N, trans_a=True, beta=beta_w)
        book.wrote(dpre)  # over act's bytes where they share a buffer (their entry goes with them)
        # on FP8 operands GELU' is applied by the pass that casts dpre for the products below
        cast = (lambda dq, dt: self._fp8_cast_dgelu(dpre, pre, N, F, C, sd, sw, dq, dt, keep_dpre)) if done_dpre else None
        if not done_dpre and not (self.blas_lt and self.blas_lt.gemm(dpre, dout, W_2, N, F, C, trans_b=True,
                                                                     epilogue="dgelu", aux=pre)):
            self.blas.gemm(dpre, dout, W_2, N, F, C, trans_b=True)
            self._gelu_grad(dpre, pre)
        # dW_1 += inp^T @ dpre, dinp = dpre @ W_1^T (a cast that left dpre unfinished finishes it for a plain product)
        unfinished = (lambda: self._gelu_grad(dpre, pre)) if done_dpre and not keep_dpre else None
        self.linear_bwd(dinp, dW_1, dpre, inp, W_1, N, C, F, 0.0 if overwrite else 1.0, cast=cast,
                        unfinished=unfinished, beta_w=beta_w)

    def _fp8_cast_dgelu(self, dpre, pre, N, F, C, dout_descale, w_descale, dq, dt, store: bool = True):
        """dpre [N, F] * GELU'(pre) as E5M2 into dq and dt ([F, N]) in one pass, at the scale of a bound of |dpre|
        (dgelu_amax: no amax pass before the cast), and with `store` into dpre too; the descale (a device word)."""
        _, out_descale = self.fp8_book.scale_slot(DPRE_SLOT)
        tile = kernel_defines("fp8")["FP8_TILE"]
        self.k["k_fp8_cast_dgelu"]((-(-F // tile), -(-N // tile)), (kernel_defines("fp8")["FP8_THREADS"],), (
            dq, dt, out_descale, dpre, pre, np.int32(N), np.int32(F), dout_descale, w_descale, dgelu_factor(C),
            np.int32(store)))
        return out_descale


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    N, F = B * T, 4 * C
    return {"mlp_fwd": (4 * N * C * F + 20 * N * F, f * (2 * N * C + 2 * N * F + 2 * C * F)),
            "mlp_bwd": (8 * N * C * F + 30 * N * F, f * (3 * N * C + 3 * N * F + 6 * C * F))}[call]


CASES = ("mlp", "mlp_recompute")
OVERWRITE_CASES = ("mlp",)


def case(name: str, s, draw: Draw) -> OpCase:
    B, T, C = s.B, s.T, s.C
    F = 4 * C
    recompute = name == "mlp_recompute"
    a = {"inp": draw.randn(B, T, C), "W_1": draw.randn(C, F, scale=C**-0.5), "W_2": draw.randn(F, C, scale=F**-0.5),
         "out": draw.nan(B, T, C), "pre": draw.nan(B, T, F), "act": draw.nan(B, T, F), "dinp": draw.grad(B, T, C),
         "dW_1": draw.grad(C, F), "dW_2": draw.grad(F, C), "dpre": draw.nan(B, T, F),
         "dout": draw.randn(B, T, C)}

    def run(E, x):
        E.mlp_fwd(x["out"], x["pre"], x["act"], x["inp"], x["W_1"], x["W_2"], recompute=recompute)
        if recompute:  # the backward must rebuild pre and act from inp
            for name in ("pre", "act"):
                E.upload(x[name], np.full(x[name].shape, np.nan, dtype=np.float32))
        E.mlp_bwd(x["dinp"], x["dW_1"], x["dW_2"], x["dpre"], x["dout"], x["inp"], x["pre"], x["act"], x["W_1"],
                  x["W_2"], recompute=recompute, overwrite=draw.overwrite, overwrite_weights=draw.overwrite)

    return OpCase(a, run, ("out", "pre", "act", "dinp", "dW_1", "dW_2", "dpre"),
                  act=("inp", "W_1", "W_2", "out", "pre", "act", "dpre", "dout", "dinp"))
