"""attn_out_fwd / attn_out_bwd: the W_O projection, out = inp @ W_O. cuBLAS products only (no kernel file), in
bf16 under precision fp8 too (andrea/ops/fp8.py says why)."""

from __future__ import annotations

from andrea.ops.base import Draw, OpCase, start_grad

KERNELS: dict = {}


def engine_buffers() -> tuple:
    return ()


class NumpyOps:
    def attn_out_fwd(self, out, inp, W_O):
        self.mm(inp, W_O, out=out)

    def attn_out_bwd(self, dinp, dW_O, dout, inp, W_O, overwrite=False, overwrite_weights=False):
        start_grad(dinp, overwrite)
        start_grad(dW_O, overwrite_weights)
        C = inp.shape[-1]
        dW_O += self.mm(inp.reshape(-1, C).T, dout.reshape(-1, dout.shape[-1]))
        dinp += self.mm(dout, W_O.T)


class CudaOps:
    def attn_out_fwd(self, out, inp, W_O):
        C = inp.shape[-1]
        N = inp.size // C
        self.fp8_book.wrote(out)
        self.linear_fwd(out, inp, W_O, N, C, C, fp8=False)

    def attn_out_bwd(self, dinp, dW_O, dout, inp, W_O, overwrite=False, overwrite_weights=False):
        C = inp.shape[-1]
        N = inp.size // C
        self.fp8_book.wrote(dinp)
        self.linear_bwd(dinp, dW_O, dout, inp, W_O, N, C, C, 0.0 if overwrite else 1.0, fp8=False,
                        beta_w=0.0 if overwrite_weights else 1.0)


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    N = B * T
    return {"attn_out_fwd": (2 * N * C * C, f * (2 * N * C + C * C)),
            "attn_out_bwd": (4 * N * C * C, f * (4 * N * C + 3 * C * C))}[call]


CASES = ("attn_out",)
OVERWRITE_CASES = ("attn_out",)


def case(name: str, s, draw: Draw) -> OpCase:
    B, T, C = s.B, s.T, s.C
    a = {"inp": draw.randn(B, T, C), "W_O": draw.randn(C, C, scale=C**-0.5), "out": draw.nan(B, T, C),
         "dinp": draw.grad(B, T, C), "dW_O": draw.grad(C, C), "dout": draw.randn(B, T, C)}

    def run(E, x):
        E.attn_out_fwd(x["out"], x["inp"], x["W_O"])
        E.attn_out_bwd(x["dinp"], x["dW_O"], x["dout"], x["inp"], x["W_O"], overwrite=draw.overwrite,
                       overwrite_weights=draw.overwrite)

    return OpCase(a, run, ("out", "dinp", "dW_O"), act=("inp", "W_O", "out", "dinp", "dout"))
