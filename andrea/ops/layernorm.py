"""layernorm_fwd / layernorm_bwd (kernels/layernorm.cu), with the residual connection fused on either
side: residual_layernorm_fwd (residual_add, then the LayerNorm reading its sum) and
layernorm_residual_bwd (the LayerNorm's backward, then that residual connection's backward in place).

Under precision fp8 the layers' LayerNorms (`e4m3`: the inputs of attn_qkv's and the MLP's products) write their
output, inside a model's pass, as E4M3 bytes only, in both layouts the products read (X^T only where a backward
follows), at the scale of `e4m3_bound`, a bound of |out| from gamma and beta known before the pass
(k_layernorm_fwd_e4m3): no amax, no cast pass, no bf16 write. The bytes are the bf16 LayerNorm's cast at that
scale. The fp8 emulation rounds out at the same scale; elsewhere the flag changes nothing."""

from __future__ import annotations

import numpy as np

from andrea.common.errors import AndreaError
from andrea.spec.memory import BufferSpec
from andrea.ops.fp8 import amax_arg, fp8_halves, fp8_shapes_ok
from andrea.ops.base import Draw, OpCase, blocks, kernel_defines, ptr, start_grad

LN_EPS = 1e-5
KERNELS = {"layernorm": ("k_layernorm_fwd", "k_layernorm_bwd", "k_layernorm_bwd_sum",
                         *(f"k_layernorm_bwd_cached{j}" for j in range(1, 5)), "k_layernorm_fwd_e4m3")}
# The cached backward (k_layernorm_bwd_cached<J>): J 16-byte groups a lane, J = 1 .. its instances above.
LN_BWD_MAX_GROUPS = 4
LN_BWD_ROWS = 32  # rows of a chunk of the cached backward (more where ln_partials could not hold that many chunks)
LN_MAX_C = 4096  # widest row the backward's partial sums (ln_partials) hold


def e4m3_bound(gamma, beta) -> float:
    """max over columns of sqrt(C - 1) |gamma| + |beta| in float32, the product and the sum rounded apart (as
    k_layernorm_fwd_e4m3 finds it): a bound of |out| for any row, whose deviations sum to 0, so that its |xhat| is
    at most sqrt(C - 1)."""
    gamma, beta = (np.asarray(v, dtype=np.float32) for v in (gamma, beta))
    k = np.float32(np.sqrt(np.float32(gamma.size - 1)))
    return float(np.max(np.abs(gamma) * k + np.abs(beta)))


def writes_e4m3(rows: int, C: int) -> bool:
    """Whether a model's pass under fp8 writes a LayerNorm output of `rows` x C as E4M3 bytes, as far as its shape
    decides (_layernorm_fwd_e4m3): shapes the FP8 products take, a row the kernel holds."""
    return fp8_shapes_ok(rows, C) and C <= kernel_defines("layernorm")["LN_E4M3_MAX_C"]


def engine_buffers() -> tuple[BufferSpec, ...]:
    """The backward's dgamma/dbeta partial sums: LN_CHUNKS chunks x (dgamma, dbeta) x LN_MAX_C."""
    return (BufferSpec("ln_partials", (2 * kernel_defines("layernorm")["LN_CHUNKS"] * LN_MAX_C,), "float32", "engine"),)


class NumpyOps:
    def layernorm_fwd(self, out, mean, rstd, inp, gamma, beta, e4m3=False):
        """`e4m3`: out as the fp8 products read it, rounded at e4m3_bound's scale (module docstring)."""
        mean[...] = inp.mean(axis=-1)
        xc = inp - mean[..., None]
        rstd[...] = 1.0 / np.sqrt((xc * xc).mean(axis=-1) + LN_EPS)
        np.multiply(xc * rstd[..., None], gamma, out=out)
        out += beta
        if e4m3:  # fp8_operand is the identity outside the fp8 emulation
            out[...] = self.fp8_operand(out, "e4m3", e4m3_bound(gamma, beta))

    def residual_layernorm_fwd(self, res_out, out, mean, rstd, a, b, gamma, beta, e4m3=False):
        """residual_add(res_out, a, b) then layernorm_fwd(out, mean, rstd, res_out, ...): the residual
        connection and the LayerNorm after it (an engine may run them as one pass)."""
        self.residual_add(res_out, a, b)
        self.layernorm_fwd(out, mean, rstd, res_out, gamma, beta, e4m3)

    def layernorm_bwd(self, dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd, overwrite=False, overwrite_weights=False):
        xhat = (inp - mean[..., None]) * rstd[..., None]
        start_grad(dinp, overwrite)
        start_grad(dgamma, overwrite_weights)
        start_grad(dbeta, overwrite_weights)
        dbeta += dout.sum(axis=(0, 1))
        dgamma += (dout * xhat).sum(axis=(0, 1))
        dxhat = dout * gamma
        dinp += rstd[..., None] * (
            dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
        )

    def layernorm_residual_bwd(self, dinp, dbranch, dgamma, dbeta, dout, inp, gamma, mean, rstd, overwrite=False,
                               overwrite_weights=False):
        """layernorm_bwd, then the backward of the residual connection in front of it, in place: the
        stream's gradient dinp flows on unchanged (x_out = x_in + branch gives d x_in = d x_out) and the
        branch's gradient dbranch is overwritten with it (an engine may run both as one pass). `overwrite`:
        dinp starts here (the top of the stream, LNf), written instead of added into."""
        self.layernorm_bwd(dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd, overwrite, overwrite_weights)
        dbranch[...] = dinp


class CudaOps:
    def layernorm_fwd(self, out, mean, rstd, inp, gamma, beta, e4m3=False):
        """`e4m3`: out written as E4M3 bytes only where the pass's products read it so (_layernorm_fwd_e4m3)."""
        self._layernorm_fwd(out, mean, rstd, inp, gamma, beta, inp, inp, 0, e4m3)

    def residual_layernorm_fwd(self, res_out, out, mean, rstd, a, b, gamma, beta, e4m3=False):
        """residual_add(res_out, a, b) then layernorm_fwd(out, mean, rstd, res_out, ...), in one pass."""
        self._layernorm_fwd(out, mean, rstd, res_out, gamma, beta, a, b, 1, e4m3)

    def _layernorm_fwd(self, out, mean, rstd, inp, gamma, beta, a, b, fused, e4m3=False):
        C = inp.shape[-1]
        rows = inp.size // C
        threads = kernel_defines("layernorm")["LN_THREADS"]
        if fused:
            self.fp8_book.wrote(inp)
        if e4m3 and self._layernorm_fwd_e4m3(out, mean, rstd, inp, gamma, beta, a, b, fused):
            return
        amax = amax_arg(self.fp8_book.produced(out))  # null outside an fp8 pass
        self.launch("k_layernorm_fwd", blocks(rows, threads // 32), threads,
                    out, mean, rstd, inp, gamma, beta, np.int64(rows), np.int32(C), a, b, np.int32(fused), amax)

    def _layernorm_fwd_e4m3(self, out, mean, rstd, inp, gamma, beta, a, b, fused) -> bool:
        """out [rows, C] as E4M3 bytes in its own: X in the first half and, where a backward follows, X^T [C, rows] in
        the second, at e4m3_bound's scale (k_layernorm_fwd_e4m3), kept in the pass's book for the products
        (Fp8Book.bytes_written) with the descale in a slot of the pass. False where the FP8 products would not read
        it so (nothing written): outside a pass, shapes they do not take, rows wider than the kernel's, not 16-byte
        aligned, or no slot left. A product that reads out as bf16 after all first has the LayerNorm run again
        from inp, the sum it wrote (Fp8Book.readable)."""
        k = kernel_defines("layernorm")
        C = inp.shape[-1]
        rows = inp.size // C
        book = self.fp8_book
        if not (self.fp8 and book.in_pass and writes_e4m3(rows, C) and all(ptr(x) % 16 == 0 for x in (out, inp, a, b))):
            return False
        slot = book.next_slot()
        if slot is None:
            return False
        book.wrote(out)
        descale = book.amax_slot(slot)[:1]
        q, qt = fp8_halves(out)
        qt = qt if book.backward_follows() else None
        self.launch("k_layernorm_fwd_e4m3", blocks(rows, k["LN_E4M3_ROWS"]), 32 * k["LN_E4M3_WARPS"], q,
                    np.uint64(0) if qt is None else qt, descale,
                    mean, rstd, inp, gamma, beta, np.int64(rows), np.int32(C), a, b, np.int32(fused))
        book.bytes_written(out, q, qt, descale,
                           lambda: self._layernorm_fwd(out, mean, rstd, inp, gamma, beta, inp, inp, 0), "e4m3")
        return True

    def layernorm_bwd(self, dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd, overwrite=False, overwrite_weights=False):
        self._layernorm_bwd(dinp, dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd, 0, overwrite, overwrite_weights)

    def layernorm_residual_bwd(self, dinp, dbranch, dgamma, dbeta, dout, inp, gamma, mean, rstd, overwrite=False,
                               overwrite_weights=False):
        """layernorm_bwd, then the residual connection in front of it in place: dinp (the stream's gradient)
        flows on unchanged and dbranch (overwritten) receives it, in one pass."""
        self._layernorm_bwd(dinp, dbranch, dgamma, dbeta, dout, inp, gamma, mean, rstd, 1, overwrite, overwrite_weights)

    def _layernorm_bwd(self, dinp, dbranch, dgamma, dbeta, dout, inp, gamma, mean, rstd, fused, overwrite,
                       overwrite_weights):
        k = kernel_defines("layernorm")
        C = inp.shape[-1]
        if C > LN_MAX_C:
            raise AndreaError(f"d_model {C} is wider than the LayerNorm backward's {LN_MAX_C} columns")
        rows = inp.size // C
        if dout.dtype != inp.dtype:  # the kernels read dout as act_t, as they read inp
            raise ValueError(f"layernorm_bwd: dout is {dout.dtype}; the gradient at the output is an activation "
                             f"gradient, {inp.dtype} like the input")
        partials = self.own["ln_partials"]
        self.fp8_book.wrote(dinp)
        amax = amax_arg(self.fp8_book.produced(dbranch) if fused else None)  # null outside an fp8 pass
        groups = -(-C // (32 * self.act_vec))
        aligned = all(ptr(a) % 16 == 0 for a in (dinp, dbranch, dout, inp, gamma))
        if groups <= LN_BWD_MAX_GROUPS and C % self.act_vec == 0 and aligned:
            capacity = partials.size // (2 * C)  # chunks whose partial sums ln_partials holds
            per_chunk = max(LN_BWD_ROWS, -(-rows // capacity))
            chunks = -(-rows // per_chunk)
            self.launch(f"k_layernorm_bwd_cached{groups}", chunks, k["LN_BWD_WARPS"] * 32,
                        dinp, dbranch, partials, dout, inp, gamma, mean, rstd, np.int64(rows), np.int32(C),
                        np.int32(per_chunk), np.int32(chunks), np.int32(fused), np.int32(not overwrite), amax)
        else:
            chunks = k["LN_CHUNKS"]
            row_blocks = blocks(rows, k["LN_THREADS"] // 32)
            self.launch("k_layernorm_bwd", row_blocks + chunks * blocks(C, 32), k["LN_THREADS"],
                        dinp, dbranch, partials, dout, inp, gamma, mean, rstd, np.int64(rows), np.int32(C),
                        np.int32(row_blocks), np.int32(fused), np.int32(not overwrite), amax)
        self.launch("k_layernorm_bwd_sum", blocks(C, 32), k["LN_SUM_THREADS"], dgamma, dbeta, partials,
                    np.int32(C), np.int32(chunks), np.int32(not overwrite_weights))


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    N = B * T
    return {"layernorm_fwd": (8 * N * C, f * 2 * N * C),
            "layernorm_bwd": (14 * N * C, f * 4 * N * C),
            "residual_layernorm_fwd": (9 * N * C, f * 4 * N * C),
            "layernorm_residual_bwd": (14 * N * C, f * 5 * N * C)}[call]


CASES = ("layernorm", "residual_layernorm", "layernorm_residual")
OVERWRITE_CASES = ("layernorm", "layernorm_residual")


def case(name: str, s, draw: Draw) -> OpCase:
    B, T, C = s.B, s.T, s.C
    if name == "layernorm":
        a = {"inp": draw.randn(B, T, C) * 3 + 1, "gamma": draw.randn(C), "beta": draw.randn(C),
             "out": draw.nan(B, T, C), "mean": draw.nan(B, T), "rstd": draw.nan(B, T),
             "dinp": draw.grad(B, T, C), "dgamma": draw.grad(C), "dbeta": draw.grad(C),
             "dout": draw.randn(B, T, C)}

        def run(E, x):
            E.layernorm_fwd(x["out"], x["mean"], x["rstd"], x["inp"], x["gamma"], x["beta"])
            E.layernorm_bwd(x["dinp"], x["dgamma"], x["dbeta"], x["dout"], x["inp"], x["gamma"], x["mean"], x["rstd"],
                            overwrite=draw.overwrite, overwrite_weights=draw.overwrite)

        return OpCase(a, run, ("out", "mean", "rstd", "dinp", "dgamma", "dbeta"), act=("inp", "out", "dout"))
    if name == "residual_layernorm":  # residual_add and the layernorm_fwd after it, as one call
        a = {"a": draw.randn(B, T, C) * 3 + 1, "b": draw.randn(B, T, C), "gamma": draw.randn(C),
             "beta": draw.randn(C), "res": draw.nan(B, T, C), "out": draw.nan(B, T, C), "mean": draw.nan(B, T),
             "rstd": draw.nan(B, T)}

        def run(E, x):
            E.residual_layernorm_fwd(x["res"], x["out"], x["mean"], x["rstd"], x["a"], x["b"], x["gamma"], x["beta"])

        return OpCase(a, run, ("res", "out", "mean", "rstd"), act=("a", "b", "res", "out"))
    # layernorm_residual: layernorm_bwd and the residual connection's backward, as one call
    a = {"inp": draw.randn(B, T, C) * 3 + 1, "gamma": draw.randn(C), "beta": draw.randn(C),
         "out": draw.nan(B, T, C), "mean": draw.nan(B, T), "rstd": draw.nan(B, T), "dinp": draw.grad(B, T, C),
         "dbranch": draw.nan(B, T, C), "dgamma": draw.grad(C), "dbeta": draw.grad(C),
         "dout": draw.randn(B, T, C)}

    def run(E, x):
        E.layernorm_fwd(x["out"], x["mean"], x["rstd"], x["inp"], x["gamma"], x["beta"])
        E.layernorm_residual_bwd(x["dinp"], x["dbranch"], x["dgamma"], x["dbeta"], x["dout"], x["inp"], x["gamma"],
                                 x["mean"], x["rstd"], overwrite=draw.overwrite, overwrite_weights=draw.overwrite)

    return OpCase(a, run, ("dinp", "dbranch", "dgamma", "dbeta"), act=("inp", "out", "dbranch", "dout"))
