"""NumPy reference engine: the oracle every other engine is checked against.

Shapes: B micro-batch, T sequence, C model width, H heads, V vocab. Activations are row-major
[B, T, C]; qkv is [3, B, T, C] (Q, K, V stacked); attention probabilities are [B, H, T, T].
Every backward op ADDS into its grad_input and grad_weight buffers (callers zero them); with
`overwrite`, an op writes its grad_input (dinp, or dqkv) instead, so that buffer needs no zeroing.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from andrea.engines.cpu_blas import BlockedProducts

LN_EPS = 1e-5
GELU_K = math.sqrt(2.0 / math.pi)


def _gelu(x):
    # x * x * x, not x**3: NumPy's float32 pow is ~30x slower than two multiplies.
    return 0.5 * x * (1.0 + np.tanh(GELU_K * (x + 0.044715 * (x * x * x))))


def _gelu_grad(x):
    th = np.tanh(GELU_K * (x + 0.044715 * (x * x * x)))
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_K * (1.0 + 3 * 0.044715 * x * x)


def _start(grad_input, overwrite: bool) -> None:
    """A backward op's input gradient: added into, or with `overwrite` written (started from zero here)."""
    if overwrite:
        grad_input[...] = 0


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


class NumpyEngine:
    name = "numpy"
    xp = np

    def __init__(self, dtype: str = "float32", threads: int | None = None):
        self.dtype = np.dtype(dtype)
        # every product through fixed blocks on one-thread BLAS: bytes independent of the thread count
        self.products = BlockedProducts(threads)
        self.mm = self.products.matmul

    # ---- buffers -------------------------------------------------------------------------
    def allocate(self, plan):
        dt = {"float32": self.dtype}  # a float64 engine runs the whole plan in float64
        return {b.name: np.zeros(b.shape, dtype=dt.get(b.dtype, np.dtype(b.dtype))) for b in plan.buffers}

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def upload(self, dst, src) -> None:
        dst[...] = src

    def synchronize(self) -> None:
        pass

    def zero(self, buf) -> None:
        buf.fill(0)

    zero_grads = zero

    def cast(self, dst, src) -> None:
        """dst = src in dst's dtype (the low-precision weight copy of mixed precision)."""
        dst[...] = src

    # ---- embed -----------------------------------------------------------------------------
    def embed_fwd(self, out, tokens, wte, wpe):
        T = tokens.shape[1]
        np.add(wte[tokens], wpe[:T], out=out)

    def embed_bwd(self, dwte, dwpe, dout, tokens):
        T = tokens.shape[1]
        # np.add.at accumulates repeated token ids in index order: deterministic.
        np.add.at(dwte, tokens.reshape(-1), dout.reshape(-1, dout.shape[-1]))
        dwpe[:T] += dout.sum(axis=0)

    # ---- layernorm -------------------------------------------------------------------------
    def layernorm_fwd(self, out, mean, rstd, inp, gamma, beta):
        mean[...] = inp.mean(axis=-1)
        xc = inp - mean[..., None]
        rstd[...] = 1.0 / np.sqrt((xc * xc).mean(axis=-1) + LN_EPS)
        np.multiply(xc * rstd[..., None], gamma, out=out)
        out += beta

    def residual_layernorm_fwd(self, res_out, out, mean, rstd, a, b, gamma, beta):
        """residual_add(res_out, a, b) then layernorm_fwd(out, mean, rstd, res_out, ...): the residual
        connection and the LayerNorm after it (an engine may run them as one pass)."""
        self.residual_add(res_out, a, b)
        self.layernorm_fwd(out, mean, rstd, res_out, gamma, beta)

    def layernorm_bwd(self, dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd):
        xhat = (inp - mean[..., None]) * rstd[..., None]
        dbeta += dout.sum(axis=(0, 1))
        dgamma += (dout * xhat).sum(axis=(0, 1))
        dxhat = dout * gamma
        dinp += rstd[..., None] * (
            dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
        )

    def layernorm_residual_bwd(self, dinp, dbranch, dgamma, dbeta, dout, inp, gamma, mean, rstd):
        """layernorm_bwd, then the backward of the residual connection in front of it, in place: the
        stream's gradient dinp flows on unchanged (x_out = x_in + branch gives d x_in = d x_out) and the
        branch's gradient dbranch is overwritten with it (an engine may run both as one pass)."""
        self.layernorm_bwd(dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd)
        dbranch[...] = dinp

    # ---- attn_qkv: Q, K, V projections ----------------------------------------------------
    def attn_qkv_fwd(self, qkv, inp, W_Q, W_K, W_V):
        for i, W in enumerate((W_Q, W_K, W_V)):
            self.mm(inp, W, out=qkv[i])

    def attn_qkv_bwd(self, dinp, dW_Q, dW_K, dW_V, dqkv, inp, W_Q, W_K, W_V, overwrite=False):
        _start(dinp, overwrite)
        C = inp.shape[-1]
        x2 = inp.reshape(-1, C)
        for i, (W, dW) in enumerate(((W_Q, dW_Q), (W_K, dW_K), (W_V, dW_V))):
            d2 = dqkv[i].reshape(-1, C)
            dW += self.mm(x2.T, d2)
            dinp += self.mm(dqkv[i], W.T)

    # ---- attn: causal scaled dot-product attention ----------------------------------------
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

    def attn_bwd(self, dqkv, datt, dout, qkv, out, att, n_head, overwrite=False):
        """`out` is the forward's Y: rowsum(dP * P) = rowsum(dY * Y), since Y = P V and dP = dY V^T."""
        _start(dqkv, overwrite)
        q, k, v = (_heads(qkv[i], n_head) for i in range(3))
        scale = 1.0 / math.sqrt(q.shape[-1])
        dy = _heads(dout, n_head)
        self.mm(dy, v.transpose(0, 1, 3, 2), out=datt)
        # softmax backward: dS = P * (dP - rowsum(dY * Y)); masked entries have P = 0.
        ds = att * (datt - (dy * _heads(out, n_head)).sum(axis=-1)[..., None]) * scale
        dqkv[0] += _merge_heads(self.mm(ds, k))
        dqkv[1] += _merge_heads(self.mm(ds.transpose(0, 1, 3, 2), q))
        dqkv[2] += _merge_heads(self.mm(att.transpose(0, 1, 3, 2), dy))

    # ---- attn_out: W_O projection ----------------------------------------------------------
    def attn_out_fwd(self, out, inp, W_O):
        self.mm(inp, W_O, out=out)

    def attn_out_bwd(self, dinp, dW_O, dout, inp, W_O, overwrite=False):
        _start(dinp, overwrite)
        C = inp.shape[-1]
        dW_O += self.mm(inp.reshape(-1, C).T, dout.reshape(-1, dout.shape[-1]))
        dinp += self.mm(dout, W_O.T)

    # ---- mlp: W_1, GELU, W_2 ---------------------------------------------------------------
    def mlp_fwd(self, out, pre, act, inp, W_1, W_2):
        self.mm(inp, W_1, out=pre)
        act[...] = _gelu(pre)
        self.mm(act, W_2, out=out)

    def mlp_bwd(self, dinp, dW_1, dW_2, dpre, dout, inp, pre, act, W_1, W_2, recompute=False, overwrite=False):
        """With `recompute`, act is stale (a buffer shared by the layers) and is first rebuilt from pre."""
        _start(dinp, overwrite)
        C, F = W_1.shape
        if recompute:
            act[...] = _gelu(pre)
        dW_2 += self.mm(act.reshape(-1, F).T, dout.reshape(-1, C))
        self.mm(dout, W_2.T, out=dpre)
        dpre *= _gelu_grad(pre)
        dW_1 += self.mm(inp.reshape(-1, C).T, dpre.reshape(-1, F))
        dinp += self.mm(dpre, W_1.T)

    # ---- residual_add ----------------------------------------------------------------------
    def residual_add(self, out, a, b):
        np.add(a, b, out=out)

    def residual_add_bwd(self, da, db, dout):
        da += dout
        db += dout

    # ---- loss: tied projection + softmax cross-entropy ------------------------------------
    def loss_fwd(self, losses, probs, inp, wte, targets):
        self.mm(inp, wte.T, out=probs)
        probs -= probs.max(axis=-1, keepdims=True)
        np.exp(probs, out=probs)
        probs /= probs.sum(axis=-1, keepdims=True)
        picked = np.take_along_axis(probs, targets[..., None], axis=-1)[..., 0]
        losses[...] = -np.log(picked)

    def loss_bwd(self, dinp, dwte, dlogits, probs, inp, wte, targets, scale, overwrite=False):
        """Gradient of scale * sum(losses): scale = 1 / (B * T) gives the mean's gradient.

        dlogits = probs - onehot(targets), the gradient of sum(losses) (scale enters the products);
        it may be probs itself, turned into the gradient in place."""
        _start(dinp, overwrite)
        picked = np.take_along_axis(probs, targets[..., None], -1)
        if dlogits is not probs:
            dlogits[...] = probs
        np.put_along_axis(dlogits, targets[..., None], picked - 1, -1)
        C = inp.shape[-1]
        V = wte.shape[0]
        t = self.dtype.type(scale)
        dwte += t * self.mm(dlogits.reshape(-1, V).T, inp.reshape(-1, C))
        dinp += t * self.mm(dlogits, wte)

    def mean_loss(self, losses) -> float:
        return float(losses.mean(dtype=np.float64))

    # ---- global-norm clipping ---------------------------------------------------------------
    def grad_norm_partial(self, partials, grads):
        chunk = -(-grads.size // partials.size)
        for i in range(partials.size):
            g = grads[i * chunk:(i + 1) * chunk]
            partials[i] = np.dot(g, g)

    def grad_norm_final(self, norm, partials):
        norm[0] = np.sqrt(partials.sum())

    def grad_scale(self, grads, scale):
        grads *= grads.dtype.type(scale)

    # ---- AdamW ------------------------------------------------------------------------------
    def adamw_step(self, params, grads, m, v, *, lr, beta1, beta2, eps, weight_decay, step, decay_ranges,
                   params_lp=None):
        """One AdamW update; `step` is 1-based (bias correction); decay only inside decay_ranges.
        `params_lp`, when given, receives the updated weights in its own dtype."""
        t = self.dtype.type
        m *= t(beta1)
        m += t(1 - beta1) * grads
        v *= t(beta2)
        v += t(1 - beta2) * grads * grads
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        update = (m / t(bc1)) / (np.sqrt(v / t(bc2)) + t(eps))
        for start, end in decay_ranges:
            update[start:end] += t(weight_decay) * params[start:end]
        params -= t(lr) * update
        if params_lp is not None:
            self.cast(params_lp, params)
