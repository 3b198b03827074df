"""Memory plan: every buffer an engine allocates, decided before training starts.

The plan is a list of named buffers with shapes and dtypes. An engine allocates each exactly once
(`engine.allocate(plan)`); the model schedule only ever reads and writes these buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from andrea.layout import ParameterLayout

# Grad-norm reduction: the flat gradient is cut into this many contiguous chunks; each chunk's
# sum of squares is one partial, and the partials are summed in index order (deterministic).
GRAD_NORM_PARTIALS = 1024
ATTENTION_SAVES = ("probs", "lse")


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str  # parameters | gradients | optimizer | activations | scratch | io

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class MemoryPlan:
    buffers: tuple[BufferSpec, ...]
    micro_batch: int
    training: bool

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
        return table


def plan_model(layout: ParameterLayout, micro_batch: int, dtype: str = "float32", training: bool = True,
               attention: str = "probs", engine_buffers: tuple[BufferSpec, ...] = ()) -> MemoryPlan:
    """All buffers for forward (and, when training, backward + AdamW) at one micro-batch size.

    `attention` is what the engine's attention saves for its backward pass, per layer in `att`:
    "probs", the [B, H, T, T] probabilities (the NumPy engine), or "lse", the per-row logsumexp
    [B, H, T] of a fused attention that recomputes the probabilities (its `d_att` scratch is [B, H, T]
    too). `engine_buffers` are the engine's own device buffers, listed so the plan covers all of them."""
    if attention not in ATTENTION_SAVES:
        raise ValueError(f"attention {attention!r}: one of {ATTENTION_SAVES}")
    s = layout.shape
    B, T, C, H, V, L = micro_batch, s.seq_len, s.d_model, s.n_head, s.vocab_size, s.n_layer
    n = layout.n_params
    scores = (B, H, T, T) if attention == "probs" else (B, H, T)
    specs: list[BufferSpec] = []

    def add(name, shape, role, dt=dtype):
        specs.append(BufferSpec(name, tuple(shape), dt, role))

    add("params", (n,), "parameters")
    if training:
        add("grads", (n,), "gradients")
        add("m", (n,), "optimizer")
        add("v", (n,), "optimizer")
        add("grad_norm_partials", (GRAD_NORM_PARTIALS,), "scratch")
        add("grad_norm", (1,), "scratch")
    add("tokens", (B, T), "io", "int32")
    add("targets", (B, T), "io", "int32")
    # Saved activations: what the backward ops read.
    add("residual", (L + 1, B, T, C), "activations")  # residual[l] enters layer l
    add("residual_mid", (L, B, T, C), "activations")  # after the attention sub-layer
    add("ln1", (L, B, T, C), "activations")
    add("ln1_mean", (L, B, T), "activations")
    add("ln1_rstd", (L, B, T), "activations")
    add("qkv", (L, 3, B, T, C), "activations")
    add("att", (L, *scores), "activations")
    add("atty", (L, B, T, C), "activations")
    add("ln2", (L, B, T, C), "activations")
    add("ln2_mean", (L, B, T), "activations")
    add("ln2_rstd", (L, B, T), "activations")
    add("mlp_pre", (L, B, T, 4 * C), "activations")
    add("mlp_act", (L, B, T, 4 * C), "activations")
    add("lnf", (B, T, C), "activations")
    add("lnf_mean", (B, T), "activations")
    add("lnf_rstd", (B, T), "activations")
    add("probs", (B, T, V), "activations")
    add("losses", (B, T), "activations")
    add("branch", (B, T, C), "scratch")  # a sub-layer's output before the residual add
    if training:
        for name, shape in (
            ("d_residual", (B, T, C)),
            ("d_residual_next", (B, T, C)),
            ("d_branch", (B, T, C)),
            ("d_ln", (B, T, C)),
            ("d_qkv", (3, B, T, C)),
            ("d_atty", (B, T, C)),
            ("d_att", scores),
            ("d_mlp_pre", (B, T, 4 * C)),
            ("d_logits", (B, T, V)),
        ):
            add(name, shape, "scratch")
    specs.extend(engine_buffers)
    return MemoryPlan(tuple(specs), micro_batch, training)
