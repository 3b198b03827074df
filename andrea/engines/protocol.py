"""The engine API, written out once: what the model schedule may call and what it may assume.

An engine declares its traits instead of being probed for them; the model reads `engine.traits`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from andrea.spec.memory import BufferSpec


@dataclass(frozen=True)
class EngineTraits:
    # What the attention saves for its backward in `att`: "probs" [B, H, T, T] or "lse" [B, H, T].
    attention: str
    # Element type of the activations in the memory plan (a 16-bit one adds the weight copy params_lp).
    act_dtype: str
    # The model keeps a dynamic loss scale (fp16).
    loss_scaling: bool
    # A micro-batch's launches can be recorded once and replayed (capture / replay).
    graphs: bool
    # Device buffers the engine holds itself (cuBLAS workspace, its ops' scratch), for the memory plan.
    own_buffers: tuple[BufferSpec, ...] = ()
    # The layers' and the classifier's products run on FP8 operands (precision fp8): a model's plan adds the
    # engine's fp8_operands (and, training, fp8_dlogits) and its own params_fp8, which it keeps current through
    # prepare_fp8_weights.
    fp8_products: bool = False
    # attn_qkv_bwd's input gradient reads each layer's W_QKV as [C, 3C] (W_Q W_K W_V side by side, its one product
    # over 3C): a training model's plan adds the copies, w_qkv_rows, which it keeps current through prepare_qkv_rows.
    qkv_weight_rows: bool = False
    # FP8 rounding with the MLP's act and the attention's dqkv at delayed scales (ops/fp8.py, the histories): a
    # training model's plan adds a row a layer of each, fp8_act_history (its passes give them to mlp_fwd and mlp_bwd)
    # and fp8_dqkv_history (to attn_bwd and attn_qkv_bwd), which its state carries.
    fp8_histories: bool = False


class Engine(Protocol):
    """Every engine: the seed's op pairs (andrea/ops/<op>.py) and the buffer plumbing below. Backward ops
    ADD (+=) into their grad_input and grad_weight buffers; with overwrite=True (attn_qkv, attn,
    attn_out, mlp, loss, layernorm) they write their grad_input instead, and with overwrite_weights=True (every op
    with a weight) their grad_weight: a step's first micro-batch writes the gradient that the others add
    into, so it is never zeroed. The tied wte's gradient is loss_bwd's to write; embed_bwd always adds
    its share into it (overwrite_weights writes dwpe only)."""

    name: str
    traits: EngineTraits
    dtype: Any
    xp: Any  # the array module (numpy or cupy)

    def allocate(self, plan, share=None) -> dict: ...  # share: (buffers, plan) of a model whose memory it uses
    def to_host(self, a, out=None): ...  # out: a host array to copy into (a's dtype and shape), returned
    def upload(self, dst, src, staged: bool = False) -> None: ...  # staged: a step's inputs (may return before the copy)
    def synchronize(self) -> None: ...
    def zero(self, buf) -> None: ...
    def zero_grads(self, grads) -> None: ...
    def cast(self, dst, src) -> None: ...
    def capture(self, fn): ...  # only where traits.graphs
    def replay(self, graph) -> None: ...  # only where traits.graphs
    def prepare_fp8_weights(self, params_fp8, layers, wte) -> None: ...  # only where traits.fp8_products
    def fp8_pass(self, backward: bool = True): ...  # only where traits.fp8_products: a context around one pass
    # of a model's ops (backward False: a forward alone, which saves nothing for a backward)
    def prepare_qkv_rows(self, w_qkv_rows, layers) -> None: ...  # only where traits.qkv_weight_rows

    def embed_fwd(self, out, tokens, wte, wpe) -> None: ...
    def embed_bwd(self, dwte, dwpe, dout, tokens, overwrite_weights=False) -> None: ...
    def layernorm_fwd(self, out, mean, rstd, inp, gamma, beta, e4m3=False) -> None: ...  # e4m3: ops/layernorm.py
    def layernorm_bwd(self, dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd, overwrite=False,
                      overwrite_weights=False) -> None: ...
    def residual_layernorm_fwd(self, res_out, out, mean, rstd, a, b, gamma, beta, e4m3=False) -> None: ...
    def layernorm_residual_bwd(self, dinp, dbranch, dgamma, dbeta, dout, inp, gamma, mean, rstd, overwrite=False,
                               overwrite_weights=False) -> None: ...
    def attn_qkv_fwd(self, qkv, inp, W_QKV) -> None: ...
    def attn_qkv_bwd(self, dinp, dW_QKV, dqkv, inp, W_QKV, overwrite=False, overwrite_weights=False,
                     dqkv_history=None) -> None: ...
    def attn_fwd(self, out, att, qkv, n_head) -> None: ...
    def attn_bwd(self, dqkv, datt, dout, qkv, out, att, n_head, overwrite=False, dqkv_history=None) -> None: ...
    def attn_out_fwd(self, out, inp, W_O) -> None: ...
    def attn_out_bwd(self, dinp, dW_O, dout, inp, W_O, overwrite=False, overwrite_weights=False) -> None: ...
    def mlp_fwd(self, out, pre, act, inp, W_1, W_2, recompute=False, act_history=None) -> None: ...
    def mlp_bwd(self, dinp, dW_1, dW_2, dpre, dout, inp, pre, act, W_1, W_2, recompute=False,
                overwrite=False, keep_dpre=True, overwrite_weights=False, act_history=None) -> None: ...
    def residual_add(self, out, a, b) -> None: ...
    def residual_add_bwd(self, da, db, dout) -> None: ...
    def loss_fwd(self, losses, probs, inp, wte, targets) -> None: ...
    # weights: None (every target counts) or a [B, T] buffer of per-position loss weights (the plan's loss_weights)
    def loss_bwd(self, dinp, dwte, probs, inp, wte, targets, scale, dlogits=None, overwrite=False,
                 weights=None, overwrite_weights=False) -> None: ...
    def mean_loss(self, losses, weights=None) -> float: ...  # float64 on the host: sum(w losses) / sum(w)
    # a training step's: each micro-batch's (sum(w losses), sum(w)) kept in a slot, read once the step is launched
    def loss_sums(self, losses, weights=None, slot: int = 0) -> None: ...
    def read_loss_sums(self, n: int) -> Any: ...  # float64 [n, 2] on the host
    def grad_norm_partial(self, partials, grads, scale=1.0) -> None: ...
    def grad_norm_final(self, norm, partials) -> None: ...
    # gate: [clipping scale, 1 where the norm and slots 0 .. n_losses - 1 are finite else 0]
    def grad_gate(self, gate, norm, n_losses: int, clip: float) -> None: ...
    # grad_scales: the gradient is read as grads x grad_scales[0] x grad_scales[1], each product rounded;
    # gate: grad_gate's, whose scale replaces grad_scales[1] and whose 0 leaves everything unchanged
    def adamw_step(self, params, grads, m, v, *, lr, beta1, beta2, eps, weight_decay, step, decay_ranges,
                   params_lp=None, grad_scales=(1.0, 1.0), gate=None) -> None: ...
