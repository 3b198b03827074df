"""loss_fwd / loss_bwd: the tied output projection and softmax cross-entropy (kernels/loss.cu).

The classifier has no gradient buffer of its own: loss_fwd turns the logits into probabilities in
`probs`, and loss_bwd turns them into d_logits in place (only the targets change) unless it is given a
separate `dlogits`; the scale enters the products as alpha."""

from __future__ import annotations

import numpy as np

from andrea.ops.base import ELEMENTWISE_THREADS, Draw, OpCase, blocks, kernel_defines, start_grad

KERNELS = {"loss": ("k_loss_fwd", "k_loss_bwd", "k_loss_bwd_in_place")}


def engine_buffers() -> tuple:
    return ()


class NumpyOps:
    def loss_fwd(self, losses, probs, inp, wte, targets):
        self.mm(inp, wte.T, out=probs)
        probs -= probs.max(axis=-1, keepdims=True)
        np.exp(probs, out=probs)
        probs /= probs.sum(axis=-1, keepdims=True)
        picked = np.take_along_axis(probs, targets[..., None], axis=-1)[..., 0]
        losses[...] = -np.log(picked)

    def loss_bwd(self, dinp, dwte, probs, inp, wte, targets, scale, dlogits=None, overwrite=False):
        """Gradient of scale * sum(losses): scale = 1 / (B * T) gives the mean's gradient.

        d_logits = probs - onehot(targets), the gradient of sum(losses) (scale enters the products): in
        `dlogits` when given, else in probs itself."""
        start_grad(dinp, overwrite)
        picked = np.take_along_axis(probs, targets[..., None], -1)
        if dlogits is None:
            dlogits = probs
        else:
            dlogits[...] = probs
        np.put_along_axis(dlogits, targets[..., None], picked - 1, -1)
        C = inp.shape[-1]
        V = wte.shape[0]
        t = self.dtype.type(scale)
        dwte += t * self.mm(dlogits.reshape(-1, V).T, inp.reshape(-1, C))
        dinp += t * self.mm(dlogits, wte)

    def mean_loss(self, losses) -> float:
        return float(losses.mean(dtype=np.float64))


class CudaOps:
    def loss_fwd(self, losses, probs, inp, wte, targets):
        V, C = wte.shape
        N = inp.size // C
        self.blas.gemm(probs, inp, wte, N, V, C, trans_b=True)
        self._launch("k_loss_fwd", N, kernel_defines("loss")["LOSS_THREADS"], losses, probs, targets, np.int64(N),
                     np.int32(V))

    def loss_bwd(self, dinp, dwte, probs, inp, wte, targets, scale, dlogits=None, overwrite=False):
        V, C = wte.shape
        N = inp.size // C
        if dlogits is None:
            self._launch("k_loss_bwd_in_place", blocks(N, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS,
                         probs, targets, np.int64(N), np.int32(V))
            dlogits = probs
        else:
            self._launch("k_loss_bwd", N, kernel_defines("loss")["LOSS_THREADS"], dlogits, probs, targets,
                         np.int64(N), np.int32(V))
        self.blas.gemm(dwte, dlogits, inp, V, C, N, trans_a=True, alpha=scale, beta=1.0)
        self.blas.gemm(dinp, dlogits, wte, N, C, V, alpha=scale, beta=0.0 if overwrite else 1.0)

    def mean_loss(self, losses) -> float:
        return float(self.to_host(losses).mean(dtype=np.float64))


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    N = B * T
    return {"loss_fwd": (2 * N * C * V + 5 * N * V, f * (N * C + V * C + N * V)),
            "loss_bwd": (4 * N * C * V + 2 * N * V, f * (2 * N * V + N * C * 2 + 3 * V * C))}[call]


CASES = ("loss", "loss_in_place")
OVERWRITE_CASES = ("loss_in_place",)


def case(name: str, s, draw: Draw) -> OpCase:
    B, T, C, V = s.B, s.T, s.C, s.V
    in_place = name == "loss_in_place"  # d_logits in probs itself, as the model runs it
    a = {"inp": draw.randn(B, T, C), "wte": draw.randn(V, C, scale=2 * C**-0.5),
         "targets": draw.rng.integers(0, V, (B, T)).astype(np.int32), "losses": draw.nan(B, T),
         "probs": draw.nan(B, T, V), "dinp": draw.grad_in(B, T, C), "dwte": draw.randn(V, C), "dlogits": draw.nan(B, T, V)}

    def run(E, x):
        E.loss_fwd(x["losses"], x["probs"], x["inp"], x["wte"], x["targets"])
        mean = E.mean_loss(x["losses"])
        E.loss_bwd(x["dinp"], x["dwte"], x["probs"], x["inp"], x["wte"], x["targets"], 1.0 / (B * T),
                   dlogits=None if in_place else x["dlogits"], overwrite=draw.overwrite)
        return {"mean_loss": mean}

    checked = ("losses", "probs", "dinp", "dwte") + (() if in_place else ("dlogits",))
    return OpCase(a, run, checked, act=("inp", "wte", "probs", "dlogits"))
