"""attn_qkv_fwd / attn_qkv_bwd: the Q, K and V projections, qkv[i] = inp @ W_QKV[i]. cuBLAS products
only (no kernel file). W_QKV is the layer's W_Q, W_K, W_V, which the parameter layout stores back to
back: one [3, C, C] view, so the CUDA half runs each direction as one batched product."""

from __future__ import annotations

from andrea.ops.base import Draw, OpCase, start_grad

KERNELS: dict = {}


def engine_buffers() -> tuple:
    return ()


class NumpyOps:
    def attn_qkv_fwd(self, qkv, inp, W_QKV):
        for i in range(3):
            self.mm(inp, W_QKV[i], out=qkv[i])

    def attn_qkv_bwd(self, dinp, dW_QKV, dqkv, inp, W_QKV, overwrite=False):
        start_grad(dinp, overwrite)
        C = inp.shape[-1]
        x2 = inp.reshape(-1, C)
        for i in range(3):
            dW_QKV[i] += self.mm(x2.T, dqkv[i].reshape(-1, C))
            dinp += self.mm(dqkv[i], W_QKV[i].T)


class CudaOps:
    def attn_qkv_fwd(self, qkv, inp, W_QKV):
        C = inp.shape[-1]
        N = inp.size // C
        self.blas.gemm(qkv, inp, W_QKV, N, C, C, batch=3, stride_b=C * C, stride_c=N * C)

    def attn_qkv_bwd(self, dinp, dW_QKV, dqkv, inp, W_QKV, overwrite=False):
        C = inp.shape[-1]
        N = inp.size // C
        # the three C x C weight gradients as one batched product
        self.blas.gemm(dW_QKV, inp, dqkv, C, C, N, trans_a=True, beta=1.0, batch=3, stride_b=N * C, stride_c=C * C)
        for i in range(3):
            self.blas.gemm(dinp, dqkv[i], W_QKV[i], N, C, C, trans_b=True, beta=0.0 if overwrite and i == 0 else 1.0)


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
