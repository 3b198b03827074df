"""Parameter layout — the only place that knows names, shapes and offsets.

All parameters live in one flat vector, in this order (row-major):

    wte [V, C]
    wpe [T, C]
    for l in 0 .. L-1:
        W_Q [C, C]  W_K [C, C]  W_V [C, C]  W_O [C, C]  W_1 [C, 4C]  W_2 [4C, C]
        LN1.gamma [C]  LN1.beta [C]  LN2.gamma [C]  LN2.beta [C]
    LNf.gamma [C]  LNf.beta [C]

Gradients, Adam m and Adam v are flat vectors of the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from andrea.spec.config import ModelShape

LAYER_TENSORS = ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2", "LN1.gamma", "LN1.beta", "LN2.gamma", "LN2.beta")


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def decays(self) -> bool:
        """AdamW weight decay applies to matrices only, never to LayerNorm gamma/beta."""
        return len(self.shape) == 2


def n_params_formula(m: ModelShape) -> int:
    V, T, C, L = m.vocab_size, m.seq_len, m.d_model, m.n_layer
    return V * C + T * C + L * (12 * C * C + 4 * C) + 2 * C


class ParameterLayout:
    def __init__(self, shape: ModelShape):
        self.shape = shape
        V, T, C, L = shape.vocab_size, shape.seq_len, shape.d_model, shape.n_layer
        shapes: list[tuple[str, tuple[int, ...]]] = [("wte", (V, C)), ("wpe", (T, C))]
        layer_shapes = {
            "W_Q": (C, C), "W_K": (C, C), "W_V": (C, C), "W_O": (C, C),
            "W_1": (C, 4 * C), "W_2": (4 * C, C),
            "LN1.gamma": (C,), "LN1.beta": (C,), "LN2.gamma": (C,), "LN2.beta": (C,),
        }
        for layer in range(L):
            shapes += [(f"h{layer}.{t}", layer_shapes[t]) for t in LAYER_TENSORS]
        shapes += [("LNf.gamma", (C,)), ("LNf.beta", (C,))]
        self.tensors: list[Tensor] = []
        offset = 0
        for name, tshape in shapes:
            self.tensors.append(Tensor(name, tshape, offset))
            offset += prod(tshape)
        self.n_params = offset
        self.by_name = {t.name: t for t in self.tensors}
        assert self.n_params == n_params_formula(shape)

    def __getitem__(self, name: str) -> Tensor:
        return self.by_name[name]

    def view(self, flat, name: str):
        """A view of one tensor inside a flat buffer (NumPy or CuPy)."""
        t = self.by_name[name]
        return flat[t.offset:t.end].reshape(t.shape)

    def layer(self, flat, layer: int) -> dict:
        """Views of one layer's tensors, keyed by their short name (W_Q, LN1.gamma, ...), and W_QKV: W_Q, W_K
        and W_V, which the layout stores back to back, as one [3, C, C] view (the attn_qkv op's weights)."""
        views = {t: self.view(flat, f"h{layer}.{t}") for t in LAYER_TENSORS}
        C = self.shape.d_model
        views["W_QKV"] = flat[self.span(f"h{layer}.W_Q", f"h{layer}.W_V")].reshape(3, C, C)
        return views

    def span(self, first: str, last: str) -> slice:
        """The flat range from tensor `first` through tensor `last` (in layout order)."""
        return slice(self.by_name[first].offset, self.by_name[last].end)

    def layer_span(self, layer: int) -> slice:
        """Layer `layer`'s tensors: one contiguous range of the flat vector."""
        return self.span(f"h{layer}.{LAYER_TENSORS[0]}", f"h{layer}.{LAYER_TENSORS[-1]}")

    def decay_ranges(self) -> list[tuple[int, int]]:
        """Contiguous [start, end) ranges that decay (merged), for engines that avoid a mask."""
        ranges: list[tuple[int, int]] = []
        for t in self.tensors:
            if t.decays:
                if ranges and ranges[-1][1] == t.offset:
                    ranges[-1] = (ranges[-1][0], t.end)
                else:
                    ranges.append((t.offset, t.end))
        return ranges
