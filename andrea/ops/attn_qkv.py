"""attn_qkv_fwd / attn_qkv_bwd: the Q, K and V projections, qkv[i] = inp @ W_QKV[i]. cuBLAS products
only (no kernel file). W_QKV is the layer's W_Q, W_K, W_V, which the parameter layout stores back to
back: one [3, C, C] view, so the CUDA half runs each direction as one batched product."""

from __future__ import annotations

from andrea.ops.base import Draw, OpCase, start_grad

KERNELS: dict = {}


def engine_buffers() -> tuple:
    return ()


class NumpyOps:
    """`fp8_operand` is what each product reads: the array itself, or in the fp8 emulation its FP8 rounding
    (engines/fp8_emulation.py), one scale per tensor as the CUDA fp8 path casts it."""

    def attn_qkv_fwd(self, qkv, inp, W_QKV):
        x, W = self.fp8_operand(inp, "e4m3"), self.fp8_operand(W_QKV, "e4m3")
        for i in range(3):
            self.mm(x, W[i], out=qkv[i])

    def attn_qkv_bwd(self, dinp, dW_QKV, dqkv, inp, W_QKV, overwrite=False):
        start_grad(dinp, overwrite)
        C = inp.shape[-1]
        x2 = self.fp8_operand(inp, "e4m3").reshape(-1, C)
        dq, W = self.fp8_operand(dqkv, "e5m2"), self.fp8_operand(W_QKV, "e4m3")
        for i in range(3):
            dW_QKV[i] += self.mm(x2.T, dq[i].reshape(-1, C))
            dinp += self.mm(dq[i], W[i].T)


class CudaOps:
    def attn_qkv_fwd(self, qkv, inp, W_QKV):
        C = inp.shape[-1]
        N = inp.size // C
        self._fp8_wrote(qkv)
        if not (self._fp8_ok(N, C) and self._attn_qkv_fwd_fp8(qkv, inp, W_QKV, N, C)):
            self.blas.gemm(qkv, inp, W_QKV, N, C, C, batch=3, stride_b=C * C, stride_c=N * C)

    def _attn_qkv_fwd_fp8(self, qkv, inp, W_QKV, N, C) -> bool:
        """qkv[i] = X @ W_i on FP8 operands: X [N, C] and each W_i^T [C, C], one batched product (False: not run)."""
        xq, wt = self._fp8_operands(N * C, 3 * C * C)
        sx = self._fp8_cast(inp, N, C, "e4m3", 0, q=xq)
        wt, sw = self._fp8_weight(W_QKV, "forward", C, C, 1, into=wt, qt_batch=C * C, batch=3)
        return self._fp8_gemm(qkv, xq, sx, "e4m3", wt, sw, "e4m3", N, C, C, batch=3, stride_b=C * C, stride_c=N * C)

    def attn_qkv_bwd(self, dinp, dW_QKV, dqkv, inp, W_QKV, overwrite=False):
        C = inp.shape[-1]
        N = inp.size // C
        self._fp8_wrote(dinp)
        done_dW, done_dinp = (self._attn_qkv_bwd_fp8(dinp, dW_QKV, dqkv, inp, W_QKV, overwrite, N, C)
                              if self._fp8_ok(N, C) else (False, False))
        if not done_dW:  # the three C x C weight gradients as one batched product
            self.blas.gemm(dW_QKV, inp, dqkv, C, C, N, trans_a=True, beta=1.0, batch=3, stride_b=N * C, stride_c=C * C)
        if not done_dinp:
            for i in range(3):
                self.blas.gemm(dinp, dqkv[i], W_QKV[i], N, C, C, trans_b=True, beta=0.0 if overwrite and i == 0 else 1.0)

    def _attn_qkv_bwd_fp8(self, dinp, dW_QKV, dqkv, inp, W_QKV, overwrite, N, C) -> tuple[bool, bool]:
        """dW_i += X^T dq_i (X^T [C, N] and each dq_i^T [C, N]: one batched product), and dinp = [dq_0 dq_1 dq_2]
        @ [W_0; W_1; W_2]^T as one product over 3C (dqkv cast side by side as [N, 3C], W_QKV as [C, 3C]).
        Which of the two ran."""
        xt, dqt, dq, w = self._fp8_operands(N * C, 3 * N * C, 3 * N * C, 3 * C * C)
        sx = self._fp8_cast(inp, N, C, "e4m3", 0, qt=xt)
        sd = self._fp8_cast(dqkv, N, C, "e5m2", 1, q=dq, ldq=3 * C, q_batch=C, qt=dqt, qt_batch=C * N, batch=3)
        w, sw = self._fp8_weight(W_QKV, "input_grad", C, C, 2, into=w, ldq=3 * C, q_batch=C, batch=3)
        return (self._fp8_gemm(dW_QKV, xt, sx, "e4m3", dqt, sd, "e5m2", C, C, N, beta=1.0, batch=3, stride_b=C * N,
                               stride_c=C * C),
                self._fp8_gemm(dinp, dq, sd, "e5m2", w, sw, "e4m3", N, C, 3 * C, beta=0.0 if overwrite else 1.0))


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    N = B * T
    return {"attn_qkv_fwd": (6 * N * C * C, f * (4 * N * C + 3 * C * C)),
            "attn_qkv_bwd": (12 * N * C * C, f * (6 * N * C + 9 * C * C))}[call]


CASES = ("attn_qkv",)
OVERWRITE_CASES = ("attn_qkv",)


def case(name: str, s, draw: Draw) -> OpCase:
    B, T, C = s.B, s.T, s.C
    w = C**-0.5
    a = {"inp": draw.randn(B, T, C), "W_QKV": draw.randn(3, C, C, scale=w), "qkv": draw.nan(3, B, T, C),
         "dinp": draw.grad_in(B, T, C), "dW_QKV": draw.randn(3, C, C), "dqkv": draw.randn(3, B, T, C)}

    def run(E, x):
        E.attn_qkv_fwd(x["qkv"], x["inp"], x["W_QKV"])
        E.attn_qkv_bwd(x["dinp"], x["dW_QKV"], x["dqkv"], x["inp"], x["W_QKV"], overwrite=draw.overwrite)

    return OpCase(a, run, ("qkv", "dinp", "dW_QKV"), act=("inp", "W_QKV", "qkv", "dqkv"))
