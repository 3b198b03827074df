"""The model schedule, written once over the engine API: forward, backward in reverse, the step.

    x = wte[tokens] + wpe[positions]
    for each layer:  x = x + attn(LN1(x));  x = x + mlp(LN2(x))
    loss = mean cross-entropy(LNf(x) @ wte.T, targets)
    (or, with loss weights w over the targets, sum(w * cross-entropy) / sum(w))
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from andrea.spec.config import ModelShape
from andrea.spec.layout import ParameterLayout
from andrea.spec.memory import layer_buffer, loss_piece, plan_model, recomputing_layers
from andrea.ops import attn_qkv, fp8, layernorm
from andrea.ops.grad_norm import clip_scale
from andrea.ops.loss import LOSS_SLOTS, weighted_mean

INIT_STD = 0.02


class NonFiniteStep(Exception):
    """A micro-batch produced a NaN/inf loss or gradient; the step made no update."""


class EmptyStep(NonFiniteStep):
    """Every loss weight of the step's batch is 0 (a loss mask that counts no target in it): its weighted
    mean loss is 0 / 0, so the step made no update; a NonFiniteStep, which the trainer skips (or stops on)."""


class LossScaleOverflow(NonFiniteStep):
    """Under a dynamic loss scale, the scaled gradients overflowed: no update, and the scale was halved."""


class LossScale:
    """Dynamic loss scale (fp16): the loss gradient is multiplied by `scale` before the backward and the
    gradients divided by it after; an overflow halves the scale and skips the step, `growth_interval`
    good steps in a row double it. Its state goes into the run's .state.json, so a resumed run continues
    with the same scale (bit-exact)."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale, self.good_steps, self.growth_interval = scale, 0, growth_interval

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.good_steps = max(self.scale / 2, 1.0), 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale, self.good_steps = self.scale * 2, 0

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "growth_interval": self.growth_interval}

    def load(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))


def weight_sum(weights: np.ndarray) -> float:
    """The total of a micro-batch's loss weights, in float64 (exact for a 0/1 mask); a negative weight is
    refused (a mean with one is no loss to descend)."""
    if np.any(weights < 0):
        raise ValueError(f"loss weights must be non-negative (found {float(np.min(weights))})")
    return float(np.sum(weights, dtype=np.float64))


def init_params(layout: ParameterLayout, seed: int) -> np.ndarray:
    """GPT-2 init: N(0, 0.02) matrices, residual projections (W_O, W_2) scaled by 1/sqrt(2L),
    LayerNorm gamma 1 and beta 0. Drawn on the host in layout order, so every engine starts equal."""
    rng = np.random.Generator(np.random.PCG64(seed))
    params = np.zeros(layout.n_params, dtype=np.float32)
    residual_std = INIT_STD / math.sqrt(2 * layout.shape.n_layer)
    for t in layout.tensors:
        view = params[t.offset:t.end]
        if t.name.endswith(".gamma"):
            view[:] = 1.0
        elif t.name.endswith(".beta"):
            continue
        else:
            std = residual_std if t.name.endswith(("W_O", "W_2")) else INIT_STD
            view[:] = rng.standard_normal(t.size, dtype=np.float32) * np.float32(std)
    return params


class Model:
    """Buffers from the memory plan plus the forward/backward schedule over one engine."""

    def __init__(self, engine, shape: ModelShape, micro_batch: int, training: bool = True, data_parallel=None,
                 recompute: tuple[str, ...] = (), recompute_layers: int | None = None, graphs: bool = True,
                 loss_chunks: int = 1, share: "Model | None" = None):
        self.engine = engine
        # A micro-batch's forward and backward run as one recorded launch sequence (a CUDA graph) where the
        # engine can record one: the same kernels in the same order, without the host's per-launch cost.
        self.graphs = graphs and engine.traits.graphs
        self._step_graphs: dict = {}  # (loss grad scale, reduce, weighted, first) -> recorded micro-batch
        self._prepare_graph = None  # the weight copies' launches, recorded (weights_changed)
        self.loss_scale = LossScale() if engine.traits.loss_scaling and training else None
        self.data_parallel = data_parallel  # andrea.run.parallel.DataParallel when training on several GPUs
        self.source_loss_sums: np.ndarray | None = None  # the last train_step's per-source losses (its `sources`)
        self.shape = shape
        self.layout = ParameterLayout(shape)
        self.micro_batch = micro_batch
        loss_rows = loss_piece(micro_batch, loss_chunks) * shape.seq_len if training else None  # a classifier piece's
        self.recompute = tuple(recompute) if training else ()
        self.recompute_layers = recomputing_layers(shape.n_layer, self.recompute, recompute_layers)
        # the layers whose MLP act the backward reads as saved (the others rebuild it)
        kept_acts = shape.n_layer - (self.recompute_layers if "gelu" in self.recompute else 0)
        # and the LayerNorm outputs whose transposes the forward saves: two a layer that keeps them, and the one
        # buffer the others share (its saved transpose is dropped when the next layer writes it)
        rebuilt_lns = self.recompute_layers if "layernorm" in self.recompute else 0
        kept_lns = 2 * (shape.n_layer - rebuilt_lns) + (1 if rebuilt_lns else 0)
        if layernorm.writes_e4m3(micro_batch * shape.seq_len, shape.d_model):
            kept_lns = 0  # the LayerNorms write X^T into their own outputs' bytes (ops/layernorm.py)
        # under FP8 rounding a training pass writes act and dqkv at the scales of amax histories, a row a layer each
        # (ops/fp8.py), and keeps their transposes in their own bytes; data-parallel ranks cast at their own amax (a
        # history would differ between ranks, and a checkpoint holds one)
        self.histories = training and engine.traits.fp8_histories and data_parallel is None
        if self.histories:
            kept_acts = 0
        copies = (fp8.plan_buffers(micro_batch, shape.seq_len, shape.d_model, shape.n_layer, shape.vocab_size, loss_rows,
                                   kept_acts, kept_lns) if engine.traits.fp8_products else ())
        if self.histories:
            copies += fp8.history_buffers(shape.n_layer)
        if training and engine.traits.qkv_weight_rows:
            copies += attn_qkv.plan_buffers(shape.d_model, shape.n_layer, engine.traits.act_dtype)
        self.plan = plan_model(self.layout, micro_batch, training=training,
                               attention=engine.traits.attention, act_dtype=engine.traits.act_dtype,
                               recompute=tuple(recompute), recompute_layers=recompute_layers, loss_chunks=loss_chunks,
                               engine_buffers=engine.traits.own_buffers + copies)
        # `share`: a model of the same shape on this engine whose weights this one reads and in whose transient
        # buffers it runs between that one's steps (memory.py); ValueError when they do not fit
        self.buf = engine.allocate(self.plan) if share is None else engine.allocate(self.plan, share=(share.buf, share.plan))
        if share is not None:
            self.plan = self.plan.sharing("another model's weights and transient buffers")
        self.training = training
        self._views("params", "P")
        # W: the weights the matrix products read: the low-precision copy under mixed precision, else P.
        if "params_lp" in self.buf:
            self._views("params_lp", "W")
        else:
            self.W = self.P
        if training:
            self._views("grads", "G")

    def _views(self, flat_name: str, attr: str) -> None:
        flat = self.buf[flat_name]
        lay = self.layout
        setattr(self, attr, {
            "wte": lay.view(flat, "wte"),
            "wpe": lay.view(flat, "wpe"),
            "LNf.gamma": lay.view(flat, "LNf.gamma"),
            "LNf.beta": lay.view(flat, "LNf.beta"),
            "layers": [lay.layer(flat, i) for i in range(self.shape.n_layer)],
        })

    # ---- state ---------------------------------------------------------------------------
    def load_state(self, params: np.ndarray, m: np.ndarray | None = None, v: np.ndarray | None = None) -> None:
        e = self.engine
        e.upload(self.buf["params"], params)
        if "params_lp" in self.buf:
            e.cast(self.buf["params_lp"], self.buf["params"])
        self.weights_changed()
        if self.training:
            e.upload(self.buf["m"], m if m is not None else np.zeros_like(params))
            e.upload(self.buf["v"], v if v is not None else np.zeros_like(params))
            e.zero_grads(self.buf["grads"])
        if self.histories:
            self.load_histories({})

    def history_state(self) -> dict:
        """The histories (ops/fp8.py) as .state.json holds them, under their buffers' names (fp8_act_history,
        fp8_dqkv_history): a list of float32 values a layer each (exact as JSON floats); empty without them."""
        if not self.histories:
            return {}
        return {f"fp8_{name}_history": self.engine.to_host(self.buf[f"fp8_{name}_history"]).astype(np.float32).tolist()
                for name in fp8.HISTORIES}

    def load_histories(self, state: dict) -> None:
        """Restore the histories history_state gave, from a dict holding them (a .state.json); one it lacks starts
        as a run does, no pass seen (a state written before the dqkv history has none of it)."""
        for name in fp8.HISTORIES:
            b, rows = self.buf[f"fp8_{name}_history"], state.get(f"fp8_{name}_history")
            host = fp8.reset_history(np.zeros(b.shape, dtype=np.float32), name) if rows is None else \
                np.asarray(rows, dtype=np.float32)
            if host.shape != tuple(b.shape):
                raise ValueError(f"a {name} history of shape {host.shape} for a model whose rows are {tuple(b.shape)}")
            self.engine.upload(b, host)

    def host_state(self, out: tuple | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of params, m and v (float32) that the next steps leave alone (a checkpoint is written from them
        while training goes on): into `out`, three such arrays of an earlier copy, else new arrays (a device's buffers
        come to the host as new arrays, the host engine's are copied)."""
        def copy(buf, into):
            if into is not None:
                return self.engine.to_host(buf, out=into)
            host = self.engine.to_host(buf)
            fresh = not (isinstance(buf, np.ndarray) and np.shares_memory(host, buf))
            return host.astype(np.float32, copy=not fresh)
        return tuple(copy(self.buf[k], into) for k, into in zip(("params", "m", "v"), out or (None,) * 3))

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, targets: np.ndarray, weights: np.ndarray | None = None) -> float:
        """Run the forward pass on one micro-batch; returns the mean loss, or with `weights` ([B, T], aligned
        with the targets) the weighted mean sum(w * loss) / sum(w), which refuses weights that count no
        target (ValueError). probs holds the last piece's probabilities: all of them with one loss chunk."""
        self._upload(tokens, targets)
        with self._pass(backward=False):
            self._forward_ops()
        return self.mean_loss(weights)

    def mean_loss(self, weights: np.ndarray | None = None) -> float:
        """The last forward's mean loss, or its weighted mean under `weights` (as forward's): a forward's losses
        are read again under other weights without a second pass (the forward itself reads no weights)."""
        if weights is not None:
            self.engine.upload(self.buf["loss_weights"], weights, staged=True)
        return self.engine.mean_loss(self.buf["losses"], None if weights is None else self.buf["loss_weights"])

    def forward_backward(self, tokens: np.ndarray, targets: np.ndarray) -> float:
        """Forward and backward of one micro-batch: adds its gradient into grads (zero after load_state; after a
        train_step, that step's gradient); returns the mean loss."""
        self._upload(tokens, targets)
        self._forward_backward()
        return self.engine.mean_loss(self.buf["losses"])

    def _upload(self, tokens: np.ndarray, targets: np.ndarray, weights: np.ndarray | None = None) -> None:
        self.engine.upload(self.buf["tokens"], tokens, staged=True)
        self.engine.upload(self.buf["targets"], targets, staged=True)
        if weights is not None:
            self.engine.upload(self.buf["loss_weights"], weights, staged=True)

    def _forward_ops(self, backward: bool = False, weighted: bool = False, first: bool = False) -> None:
        """The forward; with `backward`, each classifier piece's backward right after its loss (_classifier),
        `weighted` by the loss weights in their buffer, `first` writing wte's gradient instead of adding."""
        e, b, P, W, H = self.engine, self.buf, self.P, self.W, self.shape.n_head
        res, L = b["residual"], self.shape.n_layer
        e.embed_fwd(res[0], b["tokens"], P["wte"], P["wpe"])
        p0 = P["layers"][0]
        # The layers' LayerNorm outputs feed only attn_qkv's and the MLP's products: under fp8 they are written as
        # E4M3 bytes (`e4m3`, ops/layernorm.py); LNf's feeds the classifier and wte's gradient in bf16.
        e.layernorm_fwd(self.saved("ln1", 0), b["ln1_mean"][0], b["ln1_rstd"][0], res[0], p0["LN1.gamma"], p0["LN1.beta"],
                        e4m3=True)
        # Each residual add runs with the LayerNorm that reads its sum (residual_add, then layernorm_fwd).
        for l, (p, w) in enumerate(zip(P["layers"], W["layers"])):
            e.attn_qkv_fwd(b["qkv"][l], self.saved("ln1", l), w["W_QKV"])
            e.attn_fwd(b["atty"][l], b["att"][l], b["qkv"][l], H)
            e.attn_out_fwd(b["branch"], b["atty"][l], w["W_O"])
            e.residual_layernorm_fwd(b["residual_mid"][l], self.saved("ln2", l), b["ln2_mean"][l], b["ln2_rstd"][l],
                                     res[l], b["branch"], p["LN2.gamma"], p["LN2.beta"], e4m3=True)
            e.mlp_fwd(b["branch"], self.saved("mlp_pre", l), self.saved("mlp_act", l), self.saved("ln2", l), w["W_1"],
                      w["W_2"], recompute=self.recomputes("gelu", l), act_history=self._act_row(l) if backward else None)
            if l + 1 < L:
                q = P["layers"][l + 1]
                e.residual_layernorm_fwd(res[l + 1], self.saved("ln1", l + 1), b["ln1_mean"][l + 1], b["ln1_rstd"][l + 1],
                                         b["residual_mid"][l], b["branch"], q["LN1.gamma"], q["LN1.beta"], e4m3=True)
            else:
                e.residual_layernorm_fwd(res[L], b["lnf"], b["lnf_mean"], b["lnf_rstd"], b["residual_mid"][l], b["branch"],
                                         P["LNf.gamma"], P["LNf.beta"])
        self._classifier(backward, weighted, first)

    def _classifier(self, backward: bool, weighted: bool = False, first: bool = False) -> None:
        """The tied classifier and loss over the micro-batch, a piece of probs.shape[0] sequences at a time
        through the one probs buffer; with `backward`, each piece's loss_bwd follows its loss_fwd at once (it
        needs nothing later in the forward), adding that piece's share of wte's gradient and writing its rows
        of d_ln, the gradient at LNf's output. The piece's d_logits is `probs` itself, turned into the gradient
        in place (it is not read again); `weighted`: each row of it times the row's loss weight; `first`: the
        first piece writes wte's gradient (a step's first micro-batch), the others add theirs."""
        e, b, W = self.engine, self.buf, self.W
        rows = b["probs"].shape[0]
        for start in range(0, self.micro_batch, rows):
            piece = slice(start, min(start + rows, self.micro_batch))
            probs = b["probs"][:piece.stop - start]
            e.loss_fwd(b["losses"][piece], probs, b["lnf"][piece], W["wte"], b["targets"][piece])
            if backward:
                e.loss_bwd(b["d_ln"][piece], self.G["wte"], probs, b["lnf"][piece], W["wte"], b["targets"][piece],
                           self._loss_grad_scale(), overwrite=True,
                           weights=b["loss_weights"][piece] if weighted else None,
                           overwrite_weights=first and start == 0)

    def saved(self, name: str, l: int):
        """Layer l's activation `name`: its own slice, or the one-layer buffer the backward recomputes."""
        return layer_buffer(self.buf, name, l, self.recompute, self.recompute_layers)

    def _act_row(self, l: int):
        """Layer l's row of the act history (None without one)."""
        return self.buf["fp8_act_history"][l] if self.histories else None

    def _dqkv_row(self, l: int):
        """Layer l's row of the dqkv history (None without one)."""
        return self.buf["fp8_dqkv_history"][l] if self.histories else None

    def recomputes(self, option: str, l: int) -> bool:
        """Whether layer l's backward recomputes what `option` names."""
        return option in self.recompute and l < self.recompute_layers

    # ---- backward --------------------------------------------------------------------------
    def _backward(self, reduce: bool = False, first: bool = False) -> None:
        """Add this micro-batch's gradient of its mean loss into grads (the same list, reversed), from the
        gradient at LNf's output that the classifier's pieces left in d_ln (_classifier, in the forward);
        `first` (a step's first micro-batch): write it instead, every weight's gradient by its first op (wte's
        by the classifier, before), so that grads are never zeroed.

        `d_residual` is the residual stream's gradient, one buffer from the top to the embedding: a residual
        connection passes it on unchanged, so each one's backward is the copy into `d_branch` that the
        LayerNorm backward after it writes (layernorm_residual_bwd).

        With `reduce` (the last micro-batch of a data-parallel step) each part of the gradient starts its sum
        over the ranks as soon as it is final: LNf's, then each layer's, then wte's and wpe's after the
        embedding; the sums run beside the rest of the backward, which waits for them only at its end."""
        e, b, P, W, G, H = self.engine, self.buf, self.P, self.W, self.G, self.shape.n_head
        res, dres, d_branch = b["residual"], b["d_residual"], b["d_branch"]
        # Activation gradients are written by their first op (overwrite), not zeroed and added into: the residual
        # stream's by LNf's backward, the LayerNorm backwards below add into it.
        e.layernorm_residual_bwd(dres, d_branch, G["LNf.gamma"], G["LNf.beta"], b["d_ln"], res[-1], P["LNf.gamma"],
                                 b["lnf_mean"], b["lnf_rstd"], overwrite=True, overwrite_weights=first)
        dp, grads, lay = self.data_parallel if reduce else None, b["grads"], self.layout
        d_qkv = b["d_qkv"].transpose(2, 0, 1, 3)  # [3, B, T, C] over its rows [B, T, 3, C] (memory.py)
        if dp:
            dp.reduce_async(grads[lay.span("LNf.gamma", "LNf.beta")])
        for l in reversed(range(self.shape.n_layer)):
            p, w, g = P["layers"][l], W["layers"][l], G["layers"][l]
            # x_out = x_mid + mlp(LN2(x_mid))
            if self.recomputes("layernorm", l):
                e.layernorm_fwd(b["ln"], b["ln2_mean"][l], b["ln2_rstd"][l], b["residual_mid"][l], p["LN2.gamma"],
                                p["LN2.beta"], e4m3=True)
            # pre and act are rebuilt inside mlp_bwd; d_mlp_pre is the one-layer act buffer where there is one
            dpre = b["mlp_act_layer"] if "gelu" in self.recompute else b["d_mlp_pre"]
            e.mlp_bwd(b["d_ln"], g["W_1"], g["W_2"], dpre, d_branch, self.saved("ln2", l), self.saved("mlp_pre", l),
                      self.saved("mlp_act", l), w["W_1"], w["W_2"], recompute=self.recomputes("gelu", l), overwrite=True,
                      keep_dpre=False, overwrite_weights=first, act_history=self._act_row(l))
            e.layernorm_residual_bwd(dres, d_branch, g["LN2.gamma"], g["LN2.beta"], b["d_ln"], b["residual_mid"][l],
                                     p["LN2.gamma"], b["ln2_mean"][l], b["ln2_rstd"][l], overwrite_weights=first)
            # x_mid = x_in + attn_out(attn(attn_qkv(LN1(x_in))))
            e.attn_out_bwd(b["d_atty"], g["W_O"], d_branch, b["atty"][l], w["W_O"], overwrite=True,
                           overwrite_weights=first)
            e.attn_bwd(d_qkv, b["d_att"], b["d_atty"], b["qkv"][l], b["atty"][l], b["att"][l], H, overwrite=True,
                       dqkv_history=self._dqkv_row(l))
            if self.recomputes("layernorm", l):
                e.layernorm_fwd(b["ln"], b["ln1_mean"][l], b["ln1_rstd"][l], res[l], p["LN1.gamma"], p["LN1.beta"],
                                e4m3=True)
            e.attn_qkv_bwd(b["d_ln"], g["W_QKV"], d_qkv, self.saved("ln1", l), w["W_QKV"], overwrite=True,
                           overwrite_weights=first, dqkv_history=self._dqkv_row(l))
            ln1 = (g["LN1.gamma"], g["LN1.beta"], b["d_ln"], res[l], p["LN1.gamma"], b["ln1_mean"][l], b["ln1_rstd"][l])
            if l > 0:  # the previous layer's MLP branch joined the stream here
                e.layernorm_residual_bwd(dres, d_branch, *ln1, overwrite_weights=first)
            else:  # below layer 0 the stream is the embedding's output
                e.layernorm_bwd(dres, *ln1, overwrite_weights=first)
            if dp:
                dp.reduce_async(grads[lay.layer_span(l)])
        e.embed_bwd(G["wte"], G["wpe"], dres, b["tokens"], overwrite_weights=first)  # adds into wte's, written above
        if dp:
            dp.reduce_async(grads[lay.span("wte", "wpe")])
            dp.wait()

    def _pass(self, backward: bool = True):
        """The context of one pass of the ops over this model's buffers (`backward` False: a forward alone): under
        FP8 products the engine finds each tensor's amax once in it and, in a forward alone, saves nothing for a
        backward (ops/fp8.py, fp8_pass)."""
        return self.engine.fp8_pass(backward) if self.engine.traits.fp8_products else contextlib.nullcontext()

    @property
    def step_graphs(self) -> tuple:
        """The micro-batch recordings the model replays (_forward_backward): one a kind of micro-batch."""
        return tuple(self._step_graphs.values())

    @property
    def _scale(self) -> float:
        """The loss scale the backward runs at (1 without one)."""
        return self.loss_scale.scale if self.loss_scale else 1.0

    def _loss_grad_scale(self) -> float:
        """The scale loss_bwd runs at: d(loss)/d(losses) of a micro-batch's mean, 1 / (B * T), times the loss
        scale. A weighted loss runs at it too (train_step's unscale turns the sum into the step's weighted
        mean), so that no recording depends on a step's weights."""
        return self._scale / (self.micro_batch * self.shape.seq_len)

    def _forward_backward(self, reduce: bool = False, weighted: bool = False, first: bool = False) -> None:
        """Forward and backward of the micro-batch in the token buffers (and, `weighted`, the loss weights):
        recorded once, then replayed (again after the loss scale, which the recorded backward holds, changes).
        `reduce`: the gradient's sums over data-parallel ranks run inside the backward (a recording of its own).
        `first`: the step's first micro-batch, which writes grads where the others add (a recording of its own).

        A weighted step's loss is divided by its total weight, which changes every step; recording that
        divisor would record the step again every step, so the recorded backward runs at the unweighted
        micro-batch's constant scale and the divisor goes into the step's one unscale (train_step). The
        recordings are thus one per (reduce, weighted, first) at the current loss scale: eight at most. The constant
        scale also keeps each counted target's gradient in the backward as large as in an unweighted step,
        the range the fp16 loss scale is set for (1 / total weight would grow it as a mask counts fewer)."""
        def micro_batch():
            # the pass opens inside the recording: what it launches as it opens (fp8: its amax table zeroed) replays
            with self._pass():
                self._forward_ops(backward=True, weighted=weighted, first=first)
                self._backward(reduce, first)

        if not self.graphs:
            micro_batch()
            return
        key = self._loss_grad_scale(), reduce, weighted, first
        if key not in self._step_graphs:
            if any(k[0] != key[0] for k in self._step_graphs):  # the fp16 loss scale moved: drop stale recordings
                self._step_graphs.clear()
            self._step_graphs[key] = self.engine.capture(micro_batch)
        self.engine.replay(self._step_graphs[key])

    # ---- optimizer step --------------------------------------------------------------------
    def grad_norm(self, scale: float = 1.0) -> float:
        """The global norm of the gradient times `scale` (the gradient itself unchanged)."""
        self._grad_norm_launch(scale)
        return float(self.engine.to_host(self.buf["grad_norm"])[0])

    def _grad_norm_launch(self, scale: float) -> None:
        """grad_norm's launches, into buf["grad_norm"], not read."""
        e, b = self.engine, self.buf
        e.grad_norm_partial(b["grad_norm_partials"], b["grads"], scale=scale)
        e.grad_norm_final(b["grad_norm"], b["grad_norm_partials"])

    def train_step(self, micro_batches, *, step: int, lr: float, optimizer: dict,
                   weights: list[np.ndarray] | None = None, sources=None) -> tuple[float, float]:
        """Accumulate over micro-batches (and data-parallel ranks), scale to the step's mean, clip the
        global norm, AdamW. The first micro-batch writes grads and the others add into them: nothing zeroes
        them, and after the step (whatever it raised) they hold its gradient, unscaled, until the next one.

        `weights`: None, every target counts (the loss is the mean over the step's targets), or one float32
        [B, T] array per micro-batch, aligned with its targets (0/1 from a loss mask, or any non-negative
        value): the step's loss is sum(w * loss) / sum(w) over all its micro-batches (and ranks), and its
        gradient that loss's: every micro-batch's gradient of sum(w * loss), divided by the step's total
        weight, so each counts by its weight (no 1/n). A micro-batch of weight 0 adds nothing; a step of
        weight 0 raises EmptyStep, before any work.

        `sources`: None, or (one int array per micro-batch: the source index of each of its rows, n_sources):
        then `source_loss_sums` holds, after the step, float64 [2, n_sources]: each source's sum of (weighted)
        target losses and of target weights over the step's rows (and ranks), read from the per-target losses
        the step computes anyway (no extra forward).

        `step` counts optimizer steps already done; returns (mean loss, grad norm before clipping)."""
        e, b = self.engine, self.buf
        if weights is not None:
            if len(weights) != len(micro_batches):
                raise ValueError(f"{len(weights)} weight arrays for {len(micro_batches)} micro-batches")
            counted = [weight_sum(w) for w in weights]
            total = self._rank_sum(sum(counted))
            if total == 0:
                raise EmptyStep("no target counts in this step's batch (every loss weight is 0"
                                f"{' on every rank' if self.data_parallel is not None else ''}): "
                                "the step made no update")
        n = len(micro_batches)
        # On one GPU the whole step is launched before the host reads anything: each micro-batch's loss sums go to
        # a slot of their own, and the clipping and the decision to update (a finite norm and loss) are made on the
        # engine (grad_gate), which AdamW reads. Data-parallel ranks decide on the host, from the ranks' losses.
        deferred = self.data_parallel is None and n <= LOSS_SLOTS
        losses = []
        per_source = None if sources is None else np.zeros((2, sources[1]), dtype=np.float64)
        for i, (tokens, targets) in enumerate(micro_batches):
            w = None if weights is None else weights[i]
            self._upload(tokens, targets, w)
            # the last micro-batch's backward also sums the gradient over the data-parallel ranks
            self._forward_backward(reduce=self.data_parallel is not None and i == n - 1, weighted=w is not None,
                                   first=i == 0)
            if per_source is not None:
                self._add_source_losses(per_source, sources[0][i], w)
            if deferred:
                e.loss_sums(b["losses"], None if w is None else b["loss_weights"], slot=i)
            elif w is None:
                losses.append(e.mean_loss(b["losses"]))
            elif counted[i]:  # sum(w * loss) of the micro-batch
                losses.append(counted[i] * e.mean_loss(b["losses"], b["loss_weights"]))
        if weights is None:
            ranks = 1 if self.data_parallel is None else self.data_parallel.world
            unscale = 1.0 / (n * ranks * self._scale)
        else:
            # each micro-batch's backward ran at loss scale / (B * T) (_loss_grad_scale)
            unscale = self.micro_batch * self.shape.seq_len / (total * self._scale)
        if per_source is not None:
            self.source_loss_sums = per_source if self.data_parallel is None else \
                self.data_parallel.sum_vector(per_source.reshape(-1)).reshape(per_source.shape)
        clip = optimizer["grad_clip"]
        beta1, beta2 = optimizer["betas"]

        def update(scale: float = 1.0, gate=None):  # scale: the clipping's (gate: read from it instead)
            e.adamw_step(b["params"], b["grads"], b["m"], b["v"], lr=lr, beta1=beta1, beta2=beta2,
                         eps=optimizer["eps"], weight_decay=optimizer["weight_decay"], step=step + 1,
                         decay_ranges=self.layout.decay_ranges(), params_lp=b.get("params_lp"),
                         grad_scales=(unscale, scale), gate=gate)
            self.weights_changed()

        # The step's gradient is unscale x grads: the norm and AdamW read it so, and grads are never rewritten.
        if deferred:
            self._grad_norm_launch(unscale)
            e.grad_gate(b["grad_gate"], b["grad_norm"], n, clip)
            update(gate=b["grad_gate"])  # a gate that says no (a non-finite norm or loss) leaves the weights as they are
            sums = e.read_loss_sums(n)  # the host's one wait for the device
            norm = float(e.to_host(b["grad_norm"])[0])
            if weights is None:
                losses = [weighted_mean(*row) for row in sums]
            else:
                losses = [counted[i] * weighted_mean(*sums[i]) for i in range(n) if counted[i]]
        if weights is None:
            loss = float(np.mean(losses))
            if self.data_parallel is not None:
                loss = self.data_parallel.reduce_loss(loss)
        else:
            loss = self._rank_sum(sum(losses)) / total
        if not deferred:
            norm = self.grad_norm(unscale)
        if self.loss_scale is not None and math.isfinite(loss):
            self.loss_scale.update(overflow=not math.isfinite(norm))
            if not math.isfinite(norm):
                raise LossScaleOverflow(f"gradients overflowed at loss scale {2 * self.loss_scale.scale:g}; "
                                        f"the scale is now {self.loss_scale.scale:g}")
        if not (math.isfinite(loss) and math.isfinite(norm)):
            bad = self.nonfinite_grad_tensors()
            raise NonFiniteStep(f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} "
                                f"(loss {loss}, grad norm {norm}; non-finite gradients in: {', '.join(bad) or 'none'})")
        if not deferred:
            update(clip_scale(norm, clip))
        return loss, norm

    def weights_changed(self) -> None:
        """After W is written (its load, every AdamW step): the engine's copies of the layer matrices follow it
        before any op reads them (the FP8 copies of the layer matrices and wte under precision fp8; else the
        training model's [C, 3C] W_QKV), as a recorded graph where the engine records them."""
        b, e = self.buf, self.engine
        if "params_fp8" not in b and "w_qkv_rows" not in b:
            return

        def prepare():
            if "params_fp8" in b:
                e.prepare_fp8_weights(b["params_fp8"], self.W["layers"], self.W["wte"])
            if "w_qkv_rows" in b:
                e.prepare_qkv_rows(b["w_qkv_rows"], self.W["layers"])
        if not self.graphs:
            prepare()
            return
        if self._prepare_graph is None:  # eagerly first: the engine writes what the recorded launches read
            prepare()
            self._prepare_graph = e.capture(prepare)
            return
        e.replay(self._prepare_graph)

    def _add_source_losses(self, per_source: np.ndarray, row_sources: np.ndarray, w: np.ndarray | None) -> None:
        """Add the micro-batch's per-row sums of (weighted) target losses and of weights to their sources."""
        rows = self.engine.to_host(self.buf["losses"]).reshape(self.micro_batch, self.shape.seq_len).astype(np.float64)
        if w is None:
            sums, counts = rows.sum(axis=1), np.full(self.micro_batch, float(self.shape.seq_len))
        else:
            w = w.astype(np.float64)
            sums, counts = (rows * w).sum(axis=1), w.sum(axis=1)
        n = per_source.shape[1]
        per_source[0] += np.bincount(row_sources, weights=sums, minlength=n)
        per_source[1] += np.bincount(row_sources, weights=counts, minlength=n)

    def _rank_sum(self, x: float) -> float:
        """x summed over the data-parallel ranks (the same float on every rank); x itself on one GPU."""
        dp = self.data_parallel
        return x if dp is None else dp.reduce_loss(x) * dp.world  # reduce_loss: the ranks' mean

    def nonfinite_grad_tensors(self) -> list[str]:
        grads = self.engine.to_host(self.buf["grads"])
        return [t.name for t in self.layout.tensors if not np.isfinite(grads[t.offset:t.end]).all()]
