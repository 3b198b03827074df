"""Memory plan: every buffer an engine allocates, decided before training starts.

The plan is a list of named buffers with shapes and dtypes. An engine allocates each exactly once
(`engine.allocate(plan)`); the model schedule only ever reads and writes these buffers.

Buffers of the roles in PERSISTENT_ROLES hold state from one step to the next; the others (io,
activations, scratch) are written before they are read within every step and every forward, so
between steps another model on the same engine may use their memory: the trainer's sampler runs on the
training model's weights and inside its transient buffers (`engine.allocate(plan, share=...)`), with
no memory of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

from andrea.spec.layout import ParameterLayout

# Grad-norm reduction: the flat gradient is cut into this many contiguous chunks; each chunk's
# sum of squares is one partial, and the partials are summed in index order (deterministic).
GRAD_NORM_PARTIALS = 1024
ATTENTION_SAVES = ("probs", "lse")
# Per-layer activations the backward can recompute: name -> (the `recompute` option that drops it, the
# one-layer buffer that replaces it in the layers that recompute). ln1 and ln2 share one: only one LayerNorm
# output is in use at a time. pre and act share the option: the backward rebuilds both with the forward's product.
RECOMPUTED = {"ln1": ("layernorm", "ln"), "ln2": ("layernorm", "ln"), "mlp_pre": ("gelu", "mlp_pre_layer"),
              "mlp_act": ("gelu", "mlp_act_layer")}
RECOMPUTABLE = tuple(sorted({option for option, _ in RECOMPUTED.values()}))
# Element sizes by dtype name; bfloat16 has no NumPy dtype without ml_dtypes (CuPy brings it on GPU hosts).
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "uint8": 1}
PERSISTENT_ROLES = ("parameters", "gradients", "optimizer")  # what a step hands to the next


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    # parameters | gradients | optimizer | activations | scratch | io | engine (held by the engine itself and
    # shared by every model on it: cuBLAS's workspace, its ops' buffers)
    role: str

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class MemoryPlan:
    buffers: tuple[BufferSpec, ...]
    micro_batch: int
    training: bool
    # set when every buffer lies in another model's memory (its weights and transient buffers): what, in words
    inside: str | None = None

    def sharing(self, what: str) -> "MemoryPlan":
        return replace(self, inside=what)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def bytes_by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.buffers:
            out[b.role] = out.get(b.role, 0) + b.nbytes
        return out

    def render(self, title: str = "Memory plan"):
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        table.add_column("buffer")
        table.add_column("role")
        table.add_column("shape")
        table.add_column("dtype")
        table.add_column("bytes", justify="right")
        for b in self.buffers:
            table.add_row(b.name, b.role, "x".join(map(str, b.shape)), b.dtype, f"{b.nbytes:,}")
        table.add_section()
        for role, n in self.bytes_by_role().items():
            table.add_row(f"[dim]{role}[/dim]", "", "", "", f"{n:,}")
        table.add_row("[bold]total[/bold]", "", "", "", f"[bold]{self.total_bytes:,}[/bold] ({self.total_bytes / 2**20:.1f} MiB)")
        if self.inside:
            table.add_row("[bold]of its own[/bold]", "", "", "", f"[bold]0[/bold] (inside {self.inside})")
        return table


def device_bytes(*plans: MemoryPlan) -> int:
    """Device memory of several models on one engine (the trainer's and its sampler's): each plan's own
    buffers (none for a plan inside another's memory), and the engine's once, at the largest size a plan asks
    (the engine holds one of that size: fp8_operands)."""
    engine: dict[str, int] = {}
    for b in (b for p in plans for b in p.buffers if b.role == "engine"):
        engine[b.name] = max(engine.get(b.name, 0), b.nbytes)
    return sum(b.nbytes for p in plans if not p.inside for b in p.buffers if b.role != "engine") + sum(engine.values())


def carve(buffers, nbytes, align: int) -> tuple[list, list[int], int]:
    """The buffers in the order they are carved from one allocation, the kept ones first and the transient
    ones after them (so these form one span at its end), their offsets (each `align`-aligned), the total;
    `nbytes(b)` the bytes of a buffer on this engine."""
    ordered = sorted(buffers, key=lambda b: b.role not in PERSISTENT_ROLES)  # stable: plan order within each
    offsets, total = [], 0
    for b in ordered:
        offsets.append(total)
        total += -(-nbytes(b) // align) * align
    return ordered, offsets, total


def split_shared(plan: MemoryPlan, other_bufs: dict, other_plan: MemoryPlan, own: dict = None) -> tuple[dict, list]:
    """For a plan that shares another model's memory: its kept buffers, which must be the other's same
    buffers (the same weights), and the list of its transient buffers, to be carved from the other's
    transient span. `own`: buffers the engine holds itself (shared by every model anyway)."""
    own = own or {}
    theirs = {b.name: b for b in other_plan.buffers}
    aliased, transient = {}, []
    for b in plan.buffers:
        if b.name in own:
            continue
        if b.role not in PERSISTENT_ROLES:
            transient.append(b)
        elif theirs.get(b.name) is None or (theirs[b.name].shape, theirs[b.name].dtype) != (b.shape, b.dtype):
            raise ValueError(f"{b.name} {b.shape} {b.dtype}: the shared model has no such buffer")
        else:
            aliased[b.name] = other_bufs[b.name]
    return aliased, transient


def recomputing_layers(n_layer: int, recompute: tuple[str, ...], recompute_layers: int | None) -> int:
    """How many layers (the first ones) recompute what `recompute` names: 0 without it, else all by default."""
    if not recompute:
        return 0
    if recompute_layers is None:
        return n_layer
    if not 1 <= recompute_layers <= n_layer:
        raise ValueError(f"recompute_layers {recompute_layers}: from 1 to the model's {n_layer} layers")
    return recompute_layers


def layer_buffer(buf: dict, name: str, l: int, recompute: tuple[str, ...], r: int):
    """Layer l's activation `name` in a model's buffers: its own slice, or the one-layer buffer where layer l is
    one of the `r` that recompute it."""
    option, scratch = RECOMPUTED[name]
    if option not in recompute:
        return buf[name][l]
    return buf[scratch] if l < r else buf[name][l - r]


def loss_piece(micro_batch: int, loss_chunks: int) -> int:
    """Sequences in one classifier piece (the rows of `probs`): ceil(micro_batch / loss_chunks)."""
    return -(-micro_batch // loss_chunks)


def plan_model(layout: ParameterLayout, micro_batch: int, dtype: str = "float32", training: bool = True,
               attention: str = "probs", act_dtype: str | None = None, recompute: tuple[str, ...] = (),
               recompute_layers: int | None = None, loss_chunks: int = 1,
               engine_buffers: tuple[BufferSpec, ...] = ()) -> MemoryPlan:
    """All buffers for forward (and, when training, backward + AdamW) at one micro-batch size.

    `attention` is what the engine's attention saves for its backward pass, per layer in `att`:
    "probs", the [B, H, T, T] probabilities (the NumPy engine), or "lse", the per-row logsumexp
    [B, H, T] of a fused attention that recomputes the probabilities (its `d_att` scratch is [B, H, T]
    too). `engine_buffers` are the engine's own device buffers, listed so the plan covers all of them.

    `act_dtype` (default: `dtype`) is the element type of the activations and of the activation
    gradients that feed matrix products (bfloat16 for mixed precision); a low-precision act_dtype adds
    `params_lp`, the copy of the weights the products read (a pure function of the fp32 `params`).
    `d_ln`, the gradient at a LayerNorm's output that the products after it write, is an activation gradient too
    (as under PyTorch's autocast, whose products write theirs in bf16). Statistics, the residual stream's gradient
    (`d_residual`, which the LayerNorm backwards add into), parameters, gradients and optimizer state stay in
    `dtype`.

    `recompute` names activations kept for one layer only, which the backward recomputes: "gelu" makes
    `mlp_pre` and `mlp_act` one layer's (both rebuilt from the layer's LN2 output; the backward's d_mlp_pre
    is that act buffer in every layer: a recomputing layer's MLP backward is done reading act when it writes
    d_mlp_pre), "layernorm" replaces `ln1` and `ln2` by `ln`, the one LayerNorm output
    in use at a time (recomputed in the backward from the layer's input and its saved mean and rstd).
    `recompute_layers` (default: all) is how many layers, the first ones, recompute; the others keep theirs
    (`layer_buffer` finds layer l's).

    The classifier has no gradient buffer of its own: `loss_bwd` turns `probs` into d_logits in place.
    `loss_chunks` splits a micro-batch's classifier into pieces of whole sequences, run one at a time
    through `probs`, which holds one piece: ceil(B / loss_chunks) sequences."""
    if attention not in ATTENTION_SAVES:
        raise ValueError(f"attention {attention!r}: one of {ATTENTION_SAVES}")
    if set(recompute) - set(RECOMPUTABLE):
        raise ValueError(f"recompute {recompute!r}: from {RECOMPUTABLE}")
    recompute = recompute if training else ()
    s = layout.shape
    B, T, C, H, V, L = micro_batch, s.seq_len, s.d_model, s.n_head, s.vocab_size, s.n_layer
    r = recomputing_layers(L, recompute, recompute_layers)
    n = layout.n_params
    scores = (B, H, T, T) if attention == "probs" else (B, H, T)
    act = act_dtype or dtype
    specs: list[BufferSpec] = []

    def add(name, shape, role, dt=act):
        specs.append(BufferSpec(name, tuple(shape), dt, role))

    def stat(name, shape, role="activations"):
        add(name, shape, role, dtype)

    def saved(name, shape):
        """A per-layer activation: that of each layer that keeps it, and one layer's for those that recompute it."""
        option, scratch = RECOMPUTED[name]
        kept = L - r if option in recompute else L
        if kept:
            add(name, (kept, *shape), "activations")
        if kept < L and scratch not in {b.name for b in specs}:
            add(scratch, shape, "scratch")

    stat("params", (n,), "parameters")
    if act != dtype:
        add("params_lp", (n,), "parameters")
    if training:
        stat("grads", (n,), "gradients")
        stat("m", (n,), "optimizer")
        stat("v", (n,), "optimizer")
        stat("grad_norm_partials", (GRAD_NORM_PARTIALS,), "scratch")
        stat("grad_norm", (1,), "scratch")
        stat("grad_gate", (2,), "scratch")  # the clipping scale and whether the step updates (ops/grad_norm.py)
    add("tokens", (B, T), "io", "int32")
    add("targets", (B, T), "io", "int32")
    # The targets' loss weights (a loss mask), read only by a weighted loss; always planned: B * T floats.
    stat("loss_weights", (B, T), "io")
    # Saved activations: what the backward ops read.
    add("residual", (L + 1, B, T, C), "activations")  # residual[l] enters layer l
    add("residual_mid", (L, B, T, C), "activations")  # after the attention sub-layer
    saved("ln1", (B, T, C))
    stat("ln1_mean", (L, B, T))
    stat("ln1_rstd", (L, B, T))
    add("qkv", (L, 3, B, T, C), "activations")
    if attention == "lse":
        stat("att", (L, *scores))
    else:
        add("att", (L, *scores), "activations")
    add("atty", (L, B, T, C), "activations")
    saved("ln2", (B, T, C))
    stat("ln2_mean", (L, B, T))
    stat("ln2_rstd", (L, B, T))
    saved("mlp_pre", (B, T, 4 * C))
    saved("mlp_act", (B, T, 4 * C))
    add("lnf", (B, T, C), "activations")
    stat("lnf_mean", (B, T))
    stat("lnf_rstd", (B, T))
    add("probs", (loss_piece(B, loss_chunks), T, V), "activations")
    stat("losses", (B, T))
    add("branch", (B, T, C), "scratch")  # a sub-layer's output before the residual add
    if training:
        stat("d_residual", (B, T, C), "scratch")
        add("d_ln", (B, T, C), "scratch")  # a LayerNorm output's gradient, as the products after it write it
        add("d_branch", (B, T, C), "scratch")
        # dQ, dK, dV of a token side by side: attn_qkv_bwd's input gradient is then one product over 3C
        add("d_qkv", (B, T, 3, C), "scratch")
        add("d_atty", (B, T, C), "scratch")
        if attention == "lse":
            stat("d_att", scores, "scratch")
        else:
            add("d_att", scores, "scratch")
        if "gelu" not in recompute:
            add("d_mlp_pre", (B, T, 4 * C), "scratch")
    specs.extend(engine_buffers)
    return MemoryPlan(tuple(specs), micro_batch, training)
