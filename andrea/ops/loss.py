"""loss_fwd / loss_bwd: the tied output projection and softmax cross-entropy (kernels/loss.cu).

The classifier has no gradient buffer of its own: loss_fwd turns the logits into probabilities in
`probs`, and loss_bwd turns them into d_logits in place (only the targets change) unless it is given a
separate `dlogits`; the scale enters the products as alpha.

Loss weights (a loss mask over the targets, or any non-negative per-position weights): loss_bwd given
`weights` [B, T] makes the gradient of scale * sum(weights * losses), each row of d_logits times its
weight; loss_fwd is the same either way (per-position losses), and mean_loss takes the weighted mean in
float64 (the NumPy engine on the host, the CUDA engine on the device: the host reads its two sums). A training
step keeps each micro-batch's two sums in a slot of its own (loss_sums) and reads them all once, after its update
is launched (read_loss_sums): the host waits for the device once a step.

Precision fp8 (andrea/ops/fp8.py): the logits' product and the input gradient's run on FP8 operands, the
latter on an E5M2 copy of the unweighted d_logits that the forward's softmax writes at a fixed scale
(weighted, each row of that product is then scaled by its weight); wte's gradient stays in bf16. `fp8_operand`
is what those products read (in the NumPy engines: the array, or its FP8 rounding in the fp8 emulation)."""

from __future__ import annotations

import numpy as np

from andrea.spec.memory import BufferSpec
from andrea.ops.base import ELEMENTWISE_THREADS, Draw, OpCase, blocks, kernel_defines, ptr, start_grad
from andrea.ops.fp8 import DLOGITS_AMAX, DLOGITS_SLOT

KERNELS = {"loss": ("k_loss_fwd", "k_loss_bwd", "k_loss_bwd_in_place", "k_loss_bwd_weighted",
                   "k_loss_bwd_in_place_weighted", "k_loss_dinp_weighted", "k_loss_sums")}


# 16-byte groups of a row each thread of k_loss_fwd's block takes, at least: the block is the largest power of
# two up to LOSS_THREADS that leaves each thread this many: few threads a row for a small vocabulary, many for a
# large one, the block that suits each.
LOSS_GROUPS_PER_THREAD = 4
LOSS_DINP_BLOCKS = 4096  # k_loss_dinp_weighted's grid at most (a block a row, grid-stride past it)


def softmax_threads(V: int, act_vec: int) -> int:
    """Threads of k_loss_fwd's block for rows of V logits, act_vec a 16-byte group. The row's sums are block
    reductions whose order follows the block, so the bits are a function of V and the precision alone."""
    threads, least = kernel_defines("loss")["LOSS_THREADS"], 32
    while threads > least and threads * act_vec * LOSS_GROUPS_PER_THREAD > V:
        threads //= 2
    return threads


LOSS_SLOTS = 1024  # micro-batches a step at most: each keeps its loss sums in a slot until the step reads them


def engine_buffers() -> tuple:
    """k_loss_sums' two float64 sums a micro-batch (loss_sums' slots; mean_loss uses the first)."""
    return (BufferSpec("loss_sums", (2 * LOSS_SLOTS,), "float64", "engine"),)


def _slot(slot: int) -> int:
    if not 0 <= slot < LOSS_SLOTS:
        raise ValueError(f"loss slot {slot}: a step keeps at most {LOSS_SLOTS} micro-batches' losses")
    return slot


class NumpyOps:
    def loss_fwd(self, losses, probs, inp, wte, targets):
        self.mm(self.fp8_operand(inp, "e4m3"), self.fp8_operand(wte, "e4m3").T, out=probs)
        probs -= probs.max(axis=-1, keepdims=True)
        np.exp(probs, out=probs)
        probs /= probs.sum(axis=-1, keepdims=True)
        picked = np.take_along_axis(probs, targets[..., None], axis=-1)[..., 0]
        losses[...] = -np.log(picked)

    def loss_bwd(self, dinp, dwte, probs, inp, wte, targets, scale, dlogits=None, overwrite=False, weights=None,
                 overwrite_weights=False):
        """Gradient of scale * sum(losses): scale = 1 / (B * T) gives the mean's gradient; with `weights`
        [B, T], of scale * sum(weights * losses).

        d_logits = probs - onehot(targets), the gradient of sum(losses) (scale enters the products), each
        row times its weight when weighted: in `dlogits` when given, else in probs itself."""
        start_grad(dinp, overwrite)
        start_grad(dwte, overwrite_weights)
        picked = np.take_along_axis(probs, targets[..., None], -1)
        if dlogits is None:
            dlogits = probs
        else:
            dlogits[...] = probs
        np.put_along_axis(dlogits, targets[..., None], picked - 1, -1)
        t = self.dtype.type(scale)
        # precision fp8's input gradient reads E5M2 d_logits at the scale of its bound, unweighted (as the forward's
        # softmax writes it): the weights then scale the product's rows. fp8_operand returns dlogits itself where
        # the engine rounds nothing.
        d8 = self.fp8_operand(dlogits, "e5m2", amax=DLOGITS_AMAX)
        fp8_dinp = None if d8 is dlogits else self.mm(d8, self.fp8_operand(wte, "e4m3"))
        if weights is not None:
            dlogits *= weights[..., None]
        C = inp.shape[-1]
        V = wte.shape[0]
        dwte += t * self.mm(dlogits.reshape(-1, V).T, inp.reshape(-1, C))
        if fp8_dinp is None:
            dinp += t * self.mm(dlogits, wte)
        else:
            dinp += t * (fp8_dinp if weights is None else weights[..., None] * fp8_dinp)

    def mean_loss(self, losses, weights=None) -> float:
        return mean_loss(losses, weights)

    def loss_sums(self, losses, weights=None, slot: int = 0) -> None:
        """Keep sum(w * losses) and sum(w) in `slot` (read_loss_sums), the sums whose quotient is mean_loss."""
        self._loss_slots()[_slot(slot)] = loss_sums(losses, weights)

    def read_loss_sums(self, n: int) -> np.ndarray:
        """float64 [n, 2]: the sums kept in slots 0 .. n - 1."""
        return self._loss_slots()[:n].copy()

    def _loss_slots(self) -> np.ndarray:
        if getattr(self, "_loss_sums", None) is None:  # the engine's, made on first use
            self._loss_sums = np.zeros((LOSS_SLOTS, 2), dtype=np.float64)
        return self._loss_sums


def loss_sums(losses: np.ndarray, weights: np.ndarray | None = None) -> tuple[float, float]:
    """(sum(w * losses), sum(w)) in float64 (NumPy's pairwise sums: the same bits every run); unweighted, (sum of
    the losses, their count). Positions of weight 0 are left out, not multiplied by 0: they count for nothing
    even where their loss is not finite."""
    if weights is None:
        return float(losses.sum(dtype=np.float64)), float(losses.size)
    counted = weights != 0
    w = weights[counted].astype(np.float64)
    return float(np.sum(w * losses[counted])), float(w.sum())


def mean_loss(losses: np.ndarray, weights: np.ndarray | None = None) -> float:
    """The mean of the per-position losses, or sum(w * losses) / sum(w), in float64 (loss_sums)."""
    return weighted_mean(*loss_sums(losses, weights))


def weighted_mean(weighted_sum: float, total: float) -> float:
    """sum(w * losses) / sum(w) from the two sums; a ValueError where no position counts."""
    if total == 0:
        raise ValueError("no target counts (every loss weight is 0): the weighted mean loss is undefined")
    return float(weighted_sum / total)


class CudaOps:
    def loss_fwd(self, losses, probs, inp, wte, targets):
        V, C = wte.shape
        N = inp.size // C
        book = self.fp8_book
        book.wrote(probs)
        fp8 = book.ok(N, V, C)
        if not (fp8 and self._logits_fp8(probs, inp, wte, N, V, C)):
            self._classifier_product(probs, inp, wte, N, V, C, trans_b=True)
        # the E5M2 d_logits for loss_bwd, in a training plan's buffer (a forward alone writes none)
        dq = descale = np.uint64(0)  # null: not written
        held = self.own.get("fp8_dlogits")
        book.dlogits = None
        if fp8 and held is not None and held.size >= N * V and book.backward_follows():
            dq, (_, descale) = held[:N * V], book.scale_slot(DLOGITS_SLOT)
            book.dlogits = (ptr(probs), probs.nbytes)
        self.launch("k_loss_fwd", N, softmax_threads(V, self.act_vec), losses, probs, targets, dq, descale,
                    np.int64(N), np.int32(V))

    def _logits_fp8(self, probs, inp, wte, N, V, C) -> bool:
        """logits [N, V] = inp wte^T on E4M3 operands (wte's prepared copy as stored); False: nothing written."""
        book = self.fp8_book
        xq, wq = book.operands(N * C, 0 if book.prepared(wte) else V * C)
        sx = book.cast(inp, N, C, "e4m3", 0, q=xq, keep=False)
        wq, sw = book.weight(wte, "forward", V, C, 1, tied=True, into=wq)
        return book.gemm(probs, xq, sx, "e4m3", wq, sw, "e4m3", N, V, C, fast=True)

    def _dinp_fp8(self, dinp, probs, wte, N, C, V, scale, beta, weights=None) -> bool:
        """dinp [N, C] = scale d_logits wte (+ beta dinp) on the forward's E5M2 d_logits of these probs and wte^T
        in E4M3; False (nothing written) where the forward wrote none. That copy is unweighted: with `weights`
        the product goes to fp32 scratch (in fp8_operands), whose rows k_loss_dinp_weighted scales into dinp."""
        book = self.fp8_book
        if book.dlogits != (ptr(probs), probs.nbytes):
            return False
        book.dlogits = None  # read once: the next forward writes it again
        _, descale = book.scale_slot(DLOGITS_SLOT)
        wt, scratch = book.operands(0 if book.prepared(wte) else V * C, 0 if weights is None else 4 * N * C)
        wt, sw = book.weight(wte, "input_grad", V, C, 1, tied=True, into=wt)
        dlogits = self.own["fp8_dlogits"][:N * V]
        if weights is None:
            return book.gemm(dinp, dlogits, descale, "e5m2", wt, sw, "e4m3", N, C, V, alpha=scale, beta=beta)
        if dinp.dtype != probs.dtype:  # k_loss_dinp_weighted writes act_t
            raise ValueError(f"loss_bwd: dinp is {dinp.dtype}; the input gradient is an activation gradient, "
                             f"{probs.dtype} like probs")
        p = scratch.view(np.float32).reshape(N, C)
        if not book.gemm(p, dlogits, descale, "e5m2", wt, sw, "e4m3", N, C, V):
            return False
        self.launch("k_loss_dinp_weighted", min(N, LOSS_DINP_BLOCKS), kernel_defines("loss")["LOSS_WEIGHTED_THREADS"],
                    dinp, p, weights, np.float32(scale), np.float32(beta), np.int64(N), np.int32(C))
        return True

    def loss_bwd(self, dinp, dwte, probs, inp, wte, targets, scale, dlogits=None, overwrite=False, weights=None,
                 overwrite_weights=False):
        self.fp8_book.wrote(dinp, probs, *(() if dlogits is None else (dlogits,)))
        V, C = wte.shape
        N = inp.size // C
        if weights is not None:  # a block a row: a row whose weight is not 1 changes whole
            threads = kernel_defines("loss")["LOSS_WEIGHTED_THREADS"]
            if dlogits is None:
                self.launch("k_loss_bwd_in_place_weighted", N, threads, probs, targets, weights, np.int32(V))
                dlogits = probs
            else:
                self.launch("k_loss_bwd_weighted", N, threads, dlogits, probs, targets, weights, np.int32(V))
        elif dlogits is None:
            self.launch("k_loss_bwd_in_place", blocks(N, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS,
                        probs, targets, np.int64(N), np.int32(V))
            dlogits = probs
        else:
            self.launch("k_loss_bwd", N, kernel_defines("loss")["LOSS_THREADS"], dlogits, probs, targets,
                        np.int64(N), np.int32(V))
        self._classifier_product(dwte, dlogits, inp, V, C, N, trans_a=True, alpha=scale,
                                 beta=0.0 if overwrite_weights else 1.0)
        beta = 0.0 if overwrite else 1.0
        if not self._dinp_fp8(dinp, probs, wte, N, C, V, scale, beta, weights):
            self._classifier_product(dinp, dlogits, wte, N, C, V, alpha=scale, beta=beta)

    def _classifier_product(self, c, a, b, m, n, k, **kw):
        """Through cuBLASLt where the build has it, whose algorithm table can pick a faster algorithm than the
        heuristic's first for these shapes (andrea/engines/cublas.py); else cuBLAS."""
        if not (self.blas_lt and self.blas_lt.gemm(c, a, b, m, n, k, **kw)):
            self.blas.gemm(c, a, b, m, n, k, **kw)

    def mean_loss(self, losses, weights=None) -> float:
        """mean_loss's sums on the device (k_loss_sums, float64, a fixed order): the host reads two numbers, where
        reading every loss and weight and summing them there was slower."""
        if not (losses.flags.c_contiguous and (weights is None or weights.flags.c_contiguous)):
            raise ValueError("mean_loss: the losses and weights must be contiguous")
        self.loss_sums(losses, weights, slot=0)
        return weighted_mean(*self.read_loss_sums(1)[0])  # unweighted, total is the count

    def loss_sums(self, losses, weights=None, slot: int = 0) -> None:
        """k_loss_sums into `slot` of the engine's loss_sums: launched, not read (read_loss_sums)."""
        if not (losses.flags.c_contiguous and (weights is None or weights.flags.c_contiguous)):
            raise ValueError("loss_sums: the losses and weights must be contiguous")
        sums = self.own["loss_sums"][2 * _slot(slot):][:2]
        self.launch("k_loss_sums", 1, kernel_defines("loss")["LOSS_SUM_THREADS"], sums, losses,
                    np.uint64(0) if weights is None else weights, np.int64(losses.size))

    def read_loss_sums(self, n: int) -> np.ndarray:
        """float64 [n, 2]: the sums of slots 0 .. n - 1, read once the launches before it are done."""
        return self.to_host(self.own["loss_sums"][:2 * n]).reshape(n, 2)


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    N = B * T
    return {"loss_fwd": (2 * N * C * V + 5 * N * V, f * (N * C + V * C + N * V)),
            "loss_bwd": (4 * N * C * V + 2 * N * V, f * (2 * N * V + N * C * 2 + 3 * V * C))}[call]


CASES = ("loss", "loss_in_place", "loss_weighted", "loss_weighted_in_place")
OVERWRITE_CASES = ("loss_in_place", "loss_weighted_in_place")


def loss_weights(draw: Draw, B: int, T: int) -> np.ndarray:
    """Weights of every kind the weighted backward treats apart: 0, 1 and others (fractions, and over 1),
    mixed at random, and a block of consecutive rows of 0 (a prompt a mask leaves out)."""
    kind = draw.rng.integers(0, 3, (B, T))  # weight 0, weight 1, or another
    w = np.where(kind == 2, draw.rng.uniform(0.05, 2.0, (B, T)), kind.astype(np.float64))
    N = B * T
    w.reshape(-1)[N // 3: N // 3 + max(2, N // 4)] = 0.0
    return w


def case(name: str, s, draw: Draw) -> OpCase:
    B, T, C, V = s.B, s.T, s.C, s.V
    in_place = name.endswith("in_place")  # d_logits in probs itself, as the model runs it
    weighted = name.startswith("loss_weighted")
    a = {"inp": draw.randn(B, T, C), "wte": draw.randn(V, C, scale=2 * C**-0.5),
         "targets": draw.rng.integers(0, V, (B, T)).astype(np.int32), "losses": draw.nan(B, T),
         "probs": draw.nan(B, T, V), "dinp": draw.grad(B, T, C), "dwte": draw.grad(V, C),
         "dlogits": draw.nan(B, T, V)}
    if weighted:
        a["weights"] = loss_weights(draw, B, T)

    def run(E, x):
        weights = x["weights"] if weighted else None
        E.loss_fwd(x["losses"], x["probs"], x["inp"], x["wte"], x["targets"])
        mean = E.mean_loss(x["losses"], weights)
        E.loss_bwd(x["dinp"], x["dwte"], x["probs"], x["inp"], x["wte"], x["targets"], 1.0 / (B * T),
                   dlogits=None if in_place else x["dlogits"], overwrite=draw.overwrite, weights=weights,
                   overwrite_weights=draw.overwrite)
        return {"mean_loss": mean}

    checked = ("losses", "probs", "dinp", "dwte") + (() if in_place else ("dlogits",))
    return OpCase(a, run, checked, act=("inp", "wte", "probs", "dlogits", "dinp"))
