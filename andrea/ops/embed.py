"""embed_fwd / embed_bwd: token + position embedding (kernels/embed.cu)."""

from __future__ import annotations

import numpy as np

from andrea.common.errors import AndreaError
from andrea.spec.memory import BufferSpec
from andrea.ops.base import Draw, OpCase, kernel_defines, start_grad

# The backward's builds: J columns a thread (the EMBED_BWD instances at kernels/embed.cu's end).
EMBED_BWD_J = (1, 2, 3, 4, 8, 16)
KERNELS = {"embed": ("k_embed_fwd", "k_embed_sort", "k_embed_merge",
                     *(f"k_embed_bwd{j}" for j in EMBED_BWD_J), *(f"k_embed_bwd_sorted{j}" for j in EMBED_BWD_J))}


def engine_buffers() -> tuple:
    """The backward's keys: sorted in chunks (k_embed_sort), then in whole (k_embed_merge); an int a position
    each, up to EMBED_SORT_MAX positions."""
    return (BufferSpec("embed_sorted", (2 * kernel_defines("embed")["EMBED_SORT_MAX"],), "int32", "engine"),)


# a block per position: 128 x 16 bytes covers a bf16 row of C <= 1024 in one sweep (the kernel loops wider rows)
EMBED_FWD_THREADS = 128


class NumpyOps:
    def embed_fwd(self, out, tokens, wte, wpe):
        T = tokens.shape[1]
        np.add(wte[tokens], wpe[:T], out=out)

    def embed_bwd(self, dwte, dwpe, dout, tokens, overwrite_weights=False):
        """dwte's share is always added (loss_bwd writes the tied wte's gradient first); `overwrite_weights`
        writes dwpe."""
        T = tokens.shape[1]
        start_grad(dwpe, overwrite_weights)
        # np.add.at accumulates repeated token ids in index order: deterministic.
        np.add.at(dwte, tokens.reshape(-1), dout.reshape(-1, dout.shape[-1]))
        dwpe[:T] += dout.sum(axis=0)


class CudaOps:
    def embed_fwd(self, out, tokens, wte, wpe):
        B, T = tokens.shape
        C = wte.shape[1]
        n_pos = B * T
        self.fp8_book.wrote(out)
        self.launch("k_embed_fwd", n_pos, EMBED_FWD_THREADS, out, tokens, wte, wpe, np.int64(n_pos), np.int32(T),
                    np.int32(C))

    def embed_bwd(self, dwte, dwpe, dout, tokens, overwrite_weights=False):
        B, T = tokens.shape
        C = dwte.shape[1]
        k = kernel_defines("embed")
        threads = k["EMBED_BWD_THREADS"]
        if C > threads * max(EMBED_BWD_J):
            raise AndreaError(f"d_model {C} is wider than the embedding backward kernel's {threads * max(EMBED_BWD_J)} "
                              "columns")
        n_pos = B * T
        if overwrite_weights and T < dwpe.shape[0]:  # positions no micro-batch reaches: the kernel writes rows < T
            self.zero(dwpe[T:])
        add_wpe = np.int32(not overwrite_weights)
        j = min(j for j in EMBED_BWD_J if threads * j >= C)  # the fewest registers that cover the row
        most = k["EMBED_SORT_MAX"]
        if n_pos <= most and dwte.shape[0] <= 2**16:  # the sort's keys: token << 16 | position
            keys = self.own["embed_sorted"]
            chunks, sorted_keys = keys[:most], keys[most:]
            self.launch("k_embed_sort", -(-n_pos // k["EMBED_SORT_CHUNK"]), k["EMBED_SORT_THREADS"], chunks, tokens,
                        np.int32(n_pos))
            self.launch("k_embed_merge", -(-n_pos // threads), threads, sorted_keys, chunks, np.int32(n_pos))
            self.launch(f"k_embed_bwd_sorted{j}", n_pos + T, threads, dwte, dwpe, dout, sorted_keys, np.int64(n_pos),
                        np.int32(T), np.int32(C), add_wpe)
            return
        self.launch(f"k_embed_bwd{j}", n_pos + T, threads, dwte, dwpe, dout, tokens, np.int64(n_pos), np.int32(T),
                    np.int32(C), add_wpe)


def cost(call: str, B, T, C, H, V, n_params, f) -> tuple[float, float]:
    N = B * T
    return {"embed_fwd": (N * C, f * 3 * N * C),
            "embed_bwd": (2 * N * C, f * (N * C + 2 * min(N, V) * C + 2 * T * C))}[call]


CASES = ("embed",)
OVERWRITE_CASES = CASES


def case(name: str, s, draw: Draw) -> OpCase:
    B, T, C, V = s.B, s.T, s.C, s.V
    a = {"tokens": draw.tokens(B, T, V), "wte": draw.randn(V, C), "wpe": draw.randn(T, C),
         "out": draw.nan(B, T, C), "dwte": draw.randn(V, C), "dwpe": draw.grad(T, C), "dout": draw.randn(B, T, C)}

    def run(E, x):
        E.embed_fwd(x["out"], x["tokens"], x["wte"], x["wpe"])
        E.embed_bwd(x["dwte"], x["dwpe"], x["dout"], x["tokens"], overwrite_weights=draw.overwrite)

    return OpCase(a, run, ("out", "dwte", "dwpe"), act=("out",))
