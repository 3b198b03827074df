"""Precision fp8 (kernels/fp8.cu): FP8 operands for the products of attn_qkv, the MLP and the tied classifier's
logits and input gradient, and the CUDA engine's FP8 state behind `Fp8Book` (engine.fp8_book), whose public methods
the ops' CUDA halves call. attn_out, wte's gradient, attention, the LayerNorms' statistics and the optimizer stay
as in bf16 (attn_out's casts and wte's transposed d_logits cost more than their FP8 products save:
docs/PERFORMANCE.md, "Tried and not taken").

What a change here must keep:
- A scale is a power of two s, the largest with amax * s <= the format's largest value (E4M3 448 for activations
  and weights, E5M2 57344 for gradients); the product takes 1 / s. x * s and 1 / s are exact and amax is a max
  (any order gives it), so the scale, and the bytes, are a function of the tensor: the same bits on every run.
  `quantize` is the cast's NumPy reference, byte for byte (ml_dtypes rounds to nearest even as cvt.rn.satfinite
  does below the format's largest value).
- Current scaling: a tensor is cast right before its product at its own amax. A few take the scale of a bound
  known before they exist instead, so that their producer writes them as FP8 bytes with no amax pass: the layers'
  two LayerNorm outputs (ops/layernorm.py, e4m3_bound, from gamma and beta); the MLP backward's dpre, cast by the
  pass that applies GELU' (k_fp8_cast_dgelu) at `dgelu_amax`, a bound from its product's operand scales that is
  never under |dpre| (so nothing saturates; it sits a few powers of two above the amax, well inside E5M2's range:
  tests/test_fp8_scaling.py); the classifier's d_logits = p - onehot in [-1, 1], at amax 1's scale, written by the
  forward's softmax (`fp8_dlogits`, unweighted: with loss weights the FP8 input gradient goes to fp32 scratch
  whose rows are then scaled).
- Delayed scaling, in a training pass only: the MLP's act = GELU(pre) and the attention backward's dqkv take the
  scale of the largest amax of their layer's last FP8_HIST_PASSES passes (`HISTORIES`: a row a layer, laid out in
  kernels/fp8.cu; `fold_amax` is the fold's reference). Their producers write them as FP8 bytes at that scale
  (values past it saturate, as cvt.satfinite does) and report the amax; k_fp8_act_t writes the transpose and folds
  the pass into the row. The rows are state (.state.json), so a resume is bit-exact. A recompute rebuilds act at
  the pass's own scale (SCALE_NOW) without folding; a forward alone casts act at its own amax.
- Nothing reads an output written as FP8 bytes only (the LayerNorms', act, dqkv) as bf16: whatever would (a product
  with no FP8 algorithm, a cast) first calls Fp8Book.readable, which runs its op again for the bf16 values.
- Inside a model's pass (the engine's fp8_pass) each tensor's amax is found once: producers compute it as they
  store (the kernels' `amax` argument), and a cast's own amax pass is kept for the tensor's later casts. The bytes
  are those of casts that each run their own pass (tests/test_fp8_cuda.py compares them bit for bit). A forward
  cast whose input a weight gradient reads again (the LayerNorm outputs, act without a history) saves X^T in
  fp8_act_t for the backward; a forward alone saves nothing a backward reads (no X^T, no E5M2 d_logits).
- Accumulation: the forward products (X W, the MLP's up product, the logits) take cuBLASLt's fast accumulation;
  every gradient product promotes its partial sums to FP32 as K goes, since fast input gradients too move fp8's
  loss away from bf16's. The bits are a function of the inputs either way.
- Hopper's FP8 products take both operands K-major, so a cast writes the layouts its products read (X and W^T; dY
  and W; X^T and dY^T) in one pass, into the engine's `fp8_operands` (one op at a time, sized by `operand_bytes`),
  the descales into `fp8_scales`. The weights' copies (`params_fp8`) are cast once a weight update
  (prepare_fp8_weights).
"""

from __future__ import annotations

import contextlib

import numpy as np

from andrea.spec.memory import BufferSpec
from andrea.ops.base import blocks, kernel_defines, overlaps, ptr

KERNELS = {"fp8": ("k_fp8_amax", "k_fp8_cast", "k_fp8_amax_many", "k_fp8_cast_many", "k_fp8_cast_dgelu", "k_fp8_act_t")}
# format -> (exponent of its largest value 1.75 * 2^emax, that value)
FORMATS = {"e4m3": (8, 448.0), "e5m2": (15, 57344.0)}
GRID = {"e4m3": (3, -6), "e5m2": (2, -14)}  # format -> (mantissa bits, exponent of its smallest normal value)
CASES: tuple = ()  # the casts are checked byte for byte against `quantize` (tests/test_fp8_cuda.py)
OVERWRITE_CASES: tuple = ()
SCALE_SLOTS = 5  # operands an op casts before one product: a descale float and an amax word each, 16 bytes apart
DLOGITS_SLOT = 3  # the slot of the classifier's d_logits descale (2^-15, written by the forward's softmax)
DPRE_SLOT = 4  # the slot of the MLP backward's dpre descale (written by k_fp8_cast_dgelu, at dgelu_amax's scale)
GELU_GRAD_BOUND = 1.25  # |GELU'| <= 1.1290 (the tanh approximation's, at x = 1.4185): the bound keeps some room
DLOGITS_AMAX = 1.0  # |p - onehot| <= 1: d_logits' fixed scale is this amax's
SLOT_FLOATS = 4  # cuBLASLt takes 16-byte aligned pointers
AMAX_ROW_WORD = 13  # the weight table's first spare word a row: the amax ranges k_adamw reads (_write_weight_table)
AMAX_BLOCKS = 8 * 132  # the amax pass's grid at most: 8 blocks on each of an H100/H200's 132 SMs
ALIGN = 256


def engine_buffers() -> tuple:
    return (BufferSpec("fp8_scales", (SLOT_FLOATS * SCALE_SLOTS,), "float32", "engine"),)


def plan_buffers(B: int, T: int, C: int, L: int, V: int, loss_rows: int | None = None, kept_acts: int = 0,
                 kept_lns: int = 0) -> tuple:
    """The buffers a model's plan adds under precision fp8: the engine's operand scratch and its pass's amax
    slots (both sized by the model), the model's FP8 weight copies (`params_fp8`, derived from params_lp
    as params_lp is from params), and for a training model (`loss_rows`, the rows of its classifier's piece)
    the E5M2 copy of a piece's d_logits, `fp8_dlogits`, and the E4M3 transposes the forward saves for the
    backward, `fp8_act_t`: the act^T [4C, N] of each of the `kept_acts` layers that keep their MLP activation,
    and the [C, N] transposes of `kept_lns` LayerNorm outputs."""
    dlogits = () if loss_rows is None else (BufferSpec("fp8_dlogits", (loss_rows * V,), "uint8", "engine"),)
    saved = kept_acts * _padded(B * T * 4 * C) + kept_lns * _padded(B * T * C)
    if loss_rows is not None and saved:
        dlogits += (BufferSpec("fp8_act_t", (saved,), "uint8", "engine"),)
    return (BufferSpec("fp8_operands", (operand_bytes(B, T, C),), "uint8", "engine"),
            BufferSpec("fp8_amax", (SLOT_FLOATS * amax_slots(L),), "float32", "engine"),
            BufferSpec("params_fp8", (weight_bytes(C, L, V),), "uint8", "parameters")) + dlogits


def amax_slots(L: int) -> int:
    """Scale slots of the writes a pass keeps the amax of, a slot a write: a layer's two LayerNorm outputs (two
    more where its backward rebuilds them), its GELU output, its two LayerNorm backwards' and its attention
    backward's outputs, a cast's own amax pass (and spares); then LNf's output and spares. A pass with more
    falls back to the casts' own passes."""
    return 10 * L + 16


# The layer matrices with FP8 copies (W_O has none: attn_out stays bf16). Each is kept as the forward reads it
# (transposed) and as the input gradient reads it: attn_qkv's three side by side as [C, 3C] (its one product over
# 3C), the others as stored.
WEIGHTS = (("W_QKV", 3), ("W_1", 4), ("W_2", 4))  # name, elements in C^2


def weight_bytes(C: int, L: int, V: int) -> int:
    """Each layer matrix twice (as the forward reads it, transposed, and as the input gradient reads it), then
    wte twice (as stored and transposed), 256-byte aligned, then the casts' table (k_fp8_cast_many's) and a
    scale slot, a row of each per matrix."""
    per_layer = sum(2 * _padded(n * C * C) for _, n in WEIGHTS)
    return L * per_layer + 2 * _padded(V * C) + (L * len(WEIGHTS) + 1) * (_table_words() * 8 + SLOT_FLOATS * 4)


def _table_words() -> int:
    return kernel_defines("fp8")["FP8_TABLE_WORDS"]


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def operand_bytes(B: int, T: int, C: int) -> int:
    """The FP8 operands of the largest op, mlp_bwd's weight-gradient half: X^T [C, N], dpre and dpre^T
    [N, 4C], W_1 [C, 4C], each 256-byte aligned (attn_qkv_bwd needs 7 N C + 3 C^2, less)."""
    N, F = B * T, 4 * C
    return sum(-(-n // ALIGN) * ALIGN for n in (N * C, N * F, N * F, C * F))


# ---- the reference -----------------------------------------------------------------------------
def scale_exponent(amax: float, fmt: str) -> int:
    """e with s = 2^e the largest power of two where amax * s <= the format's largest value (float32 amax;
    0 for amax 0), kept inside float32's normal range: kernels/common.cuh's fp8_scale_exponent."""
    bits = int(np.float32(amax).view(np.uint32))
    if bits == 0:
        return 0
    emax = FORMATS[fmt][0]
    k = ((bits >> 23) & 0xFF) - 127
    e = emax - k - (1 if (bits & 0x7FFFFF) > 0x600000 else 0)
    return max(-126, min(127, e))


def own_amax(xp, x) -> float:
    """max |x| of a float32 array of the array module xp (NumPy or CuPy); 0 for an empty one."""
    return float(xp.abs(x).max()) if x.size else 0.0


def descale(x: np.ndarray, fmt: str) -> float:
    """1 / s of x's own scale (as quantize gives it)."""
    return 2.0 ** -scale_exponent(own_amax(np, np.asarray(x, dtype=np.float32)), fmt)


def dgelu_factor(C: int) -> np.float32:
    """C * 57344 * 448 * GELU_GRAD_BOUND in float32: k_fp8_cast_dgelu's `factor` for a product over C."""
    return np.float32(C) * np.float32(FORMATS["e5m2"][1] * FORMATS["e4m3"][1] * GELU_GRAD_BOUND)


def dgelu_amax(C: int, dout_descale: float, w_descale: float) -> float:
    """The amax whose scale the MLP backward's E5M2 dpre = (dout @ W_2^T) * GELU'(pre) takes (k_fp8_cast_dgelu): a
    bound of |dpre| from the product's FP8 operands, whose values are at most 57344 times dout's descale and 448
    times W_2's, C terms a sum. The kernel computes the same float32 products in the same order."""
    return float(dgelu_factor(C) * np.float32(dout_descale) * np.float32(w_descale))


# ---- tensors under delayed scaling: the act and dqkv histories -------------------------------
# A history's tensor -> (its format, the amax whose scale a run's first pass takes): act starts at the scale 1 (amax
# 0, no pass seen); dqkv, a mean loss's gradient, at that of amax 1, so that its first pass keeps values down to
# 2^-31 (at the scale 1 most of them would flush to zero before the history has seen one pass).
HISTORIES = {"act": ("e4m3", 0.0), "dqkv": ("e5m2", 1.0)}


def history_field(name: str) -> int:
    """The offset of a field of a layer's history row (kernels/fp8.cu's FP8_HIST_<NAME>), or its sizes ("PASSES",
    "ROW")."""
    return kernel_defines("fp8")[f"FP8_HIST_{name}"]


def history_slot(row, name: str):
    """A one-float view of a field of a layer's history row (a device pointer for cuBLASLt or a kernel)."""
    at = history_field(name)
    return row[at:at + 1]


def act_t_grid(rows: int, cols: int) -> tuple[int, int]:
    """k_fp8_act_t's grid transposing FP8 bytes [rows, cols]: a block a 64-column strip of FP8_ACT_T_SUB tiles."""
    d = kernel_defines("fp8")
    return -(-cols // d["FP8_TILE"]), -(-rows // (d["FP8_TILE"] * d["FP8_ACT_T_SUB"]))


def history_buffers(L: int) -> tuple:
    """A training model's histories under fp8 rounding (`fp8_<tensor>_history`): a row a layer each (kernels/fp8.cu),
    state carried from step to step (and in .state.json), as m and v are."""
    return tuple(BufferSpec(f"fp8_{name}_history", (L, history_field("ROW")), "float32", "optimizer")
                 for name in HISTORIES)


def reset_history(rows: np.ndarray, name: str) -> np.ndarray:
    """The rows of a run's start (host float32) of history `name`: no pass seen, the first pass's scale that of the
    history's start amax (HISTORIES)."""
    fmt, start = HISTORIES[name]
    rows[...] = 0
    rows[..., history_field("SCALE")] = np.float32(2.0 ** scale_exponent(start, fmt))
    return rows


def fold_amax(row, amax: float, fmt: str) -> None:
    """The reference of kernels/fp8.cu's history_fold on a row of any float array, after a pass whose tensor (in
    `fmt`) had amax `amax`: the pass's scale becomes this pass's, the amax goes into the history (the amax word back
    to 0), and the next pass's scale is that of the history's largest (NaN passed over)."""
    e = int(np.float32(row[history_field("SCALE")]).view(np.uint32) >> 23 & 0xFF) - 127
    row[history_field("SCALE_NOW")] = row[history_field("SCALE")]
    row[history_field("DESCALE_NOW")] = np.float32(2.0**-e)
    at, past, n = int(row[history_field("AT")]), history_field("PAST"), history_field("PASSES")
    row[past + at] = np.float32(amax)
    row[history_field("AMAX")] = 0.0
    row[history_field("AT")] = (at + 1) % n
    largest = float(np.fmax.reduce(np.asarray(row[past:past + n], dtype=np.float32), initial=0.0))
    row[history_field("SCALE")] = np.float32(2.0 ** scale_exponent(largest, fmt))


def amax_now(row, fmt: str) -> float:
    """The amax whose scale in `fmt` is this pass's scale of the row's tensor (its DESCALE_NOW): quantize /
    fake_quantize at it cast the tensor as the pass's producer wrote it."""
    return FORMATS[fmt][1] * float(row[history_field("DESCALE_NOW")])


def delayed_amax(row, x, fold: bool, fmt: str) -> float | None:
    """What the fp8 rounding of x takes as its amax in a pass with its layer's history `row` (None: x's own amax, no
    history): the pass's scale; `fold` (x's producer), after folding x's amax into the row."""
    if row is None:
        return None
    if fold:
        fold_amax(row, own_amax(np, np.asarray(x, dtype=np.float32)), fmt)
    return amax_now(row, fmt)


def ml_dtype(fmt: str):
    """The NumPy type of a format (ml_dtypes)."""
    import ml_dtypes

    return {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]


def quantize(x: np.ndarray, fmt: str, amax: float | None = None) -> tuple[np.ndarray, float]:
    """(the FP8 bytes of x as uint8, the descale 1 / s): the engine's cast of the same float32 values. `amax`: at the
    scale of that amax instead of x's own (a bound of |x|; values over it saturate, as cvt.satfinite does)."""
    x = np.asarray(x, dtype=np.float32)
    if amax is None:
        amax = own_amax(np, x)
    e = scale_exponent(amax, fmt)
    largest = np.float32(FORMATS[fmt][1])
    q = np.clip(x * np.float32(2.0**e), -largest, largest).astype(ml_dtype(fmt))
    return q.view(np.uint8), 2.0**-e


def fake_quantize(xp, x, fmt: str, amax: float | None = None):
    """dequantize(*quantize(x)) as float32 in array arithmetic of the array module xp (NumPy or CuPy): the
    cast's values without FP8 types, so that they can feed products of other precisions on any device (the
    CPU emulation, engines/fp8_emulation.py; an FP8 product emulated on the GPU). The values have at most 4
    significant bits: exact in bf16. `amax`: the scale of that amax instead of x's own (a bound of |x|)."""
    mantissa, min_exp = GRID[fmt]
    x = xp.asarray(x, dtype=xp.float32)
    if amax is None:
        amax = own_amax(xp, x)
    e = scale_exponent(amax, fmt)
    a = xp.abs(x) * xp.float32(2.0**e)
    _, ex = xp.frexp(a)  # a in [2^(ex-1), 2^ex); below the smallest normal the spacing stays that of min_exp
    step = xp.ldexp(xp.ones_like(a), xp.maximum(ex - 1, min_exp) - mantissa)
    r = xp.minimum(xp.rint(a / step) * step, xp.float32(FORMATS[fmt][1]))  # rint: to nearest even
    return xp.copysign(r, x) * xp.float32(2.0**-e)


def dequantize(q: np.ndarray, descale: float, fmt: str) -> np.ndarray:
    """float64 values of FP8 bytes times their descale."""
    return q.view(ml_dtype(fmt)).astype(np.float64) * descale


# ---- CUDA --------------------------------------------------------------------------------------
class CudaOps:
    """The CUDA engine's FP8 calls (its state, casts and FP8 products are its `fp8_book`, an Fp8Book) and the layers'
    linear products, on FP8 operands where the op takes them, else plain."""

    def prepare_fp8_weights(self, params_fp8, layers, wte) -> None:
        """The FP8 copies of the model's weights for the products (Fp8Book.prepare_weights)."""
        self.fp8_book.prepare_weights(params_fp8, layers, wte)

    def fp8_pass(self, backward: bool = True):
        """A context around one pass of a model over its own buffers (Fp8Book.open_pass)."""
        return self.fp8_book.open_pass(backward)

    def linear_fwd(self, out, inp, W, N, K, M, fp8: bool = True, save_transpose: bool = False) -> None:
        """out [N, M] = inp [N, K] @ W [K, M]: on FP8 operands where the op takes them, else the plain product
        (`fp8=False`: the plain product in every precision). `save_transpose`: the cast keeps inp^T for the
        backward where it can (Fp8Book.saved_transpose)."""
        book = self.fp8_book
        if not (fp8 and book.ok(N, K, M) and book.linear_fwd(out, inp, W, N, K, M, save_transpose=save_transpose)):
            book.readable(inp)
            self.blas.gemm(out, inp, W, N, M, K)

    def linear_bwd(self, dinp, dW, dout, inp, W, N, K, M, beta: float, fp8: bool = True, cast=None,
                   unfinished=None, beta_w: float = 1.0) -> None:
        """dW [K, M] = inp^T @ dout + beta_w * dW and dinp [N, K] = dout @ W^T + beta * dinp: on FP8 operands where
        the op takes them, else (each product on its own) the plain products (`fp8=False`: in every precision). `cast`:
        as Fp8Book.linear_bwd's (the caller gives it only where Fp8Book.ok); `unfinished()` makes dout what the plain
        products read where that cast left it otherwise."""
        book = self.fp8_book
        on_fp8 = fp8 and book.ok(N, K, M)
        if cast is not None and not on_fp8:
            raise RuntimeError("linear_bwd: a cast of dout given for products that do not run on FP8 operands")
        done_dW, done_dinp, *_ = (book.linear_bwd(dinp, dW, dout, inp, W, N, K, M, beta, cast, beta_w)
                                  if on_fp8 else (False, False))
        if unfinished is not None and not (done_dW and done_dinp):
            unfinished()
        if not done_dW:
            book.readable(inp)
            self.blas.gemm(dW, inp, dout, K, M, N, trans_a=True, beta=beta_w)
        if not done_dinp:
            self.blas.gemm(dinp, dout, W, N, K, M, trans_b=True, beta=beta)


class Fp8Book:
    """What the CUDA engine knows of its FP8 tensors, and the casts and FP8 products that read and keep it: the
    weights' FP8 copies and their cast table, the open pass's book (below), the tensors' places in fp8_act_t and
    the classifier's E5M2 d_logits. The op modules' CUDA halves go through these methods (`self.fp8_book`); only
    this module reads the state itself.

    Each FP8 product here returns False where cuBLASLt has no FP8 algorithm for the shape (a dimension not a
    multiple of 16, say): nothing was written, and the op runs its bf16 products instead."""

    def __init__(self, engine):
        self.engine = engine  # what the book launches through: k, launch, zero, own (buffers), blas_lt, fp8
        self._weights: dict = {}  # weight pointer -> its FP8 copies (prepare_weights)
        self._table = None  # (the weights' key, (amax chunks, cast tiles)) of the cast table last written in params_fp8
        self._amax_rows = None  # (rows, count, lo, hi) of that table's amax ranges, for adamw_step (weight_amax_rows)
        self._pass: dict | None = None  # inside open_pass: the tensors whose amax is current (below)
        self._act_t_places: dict = {}  # (fp8_act_t, tensor) -> the tensor's place there (_transpose_place)
        self.dlogits = None  # (pointer, bytes) of the probs whose E5M2 d_logits fp8_dlogits holds (ops/loss.py)

    def ok(self, *dims: int) -> bool:
        """Whether a product runs on FP8 operands: precision fp8, and dimensions cuBLASLt's FP8 kernels take
        (the tokens and the widths, multiples of 16)."""
        return self.engine.fp8 and fp8_shapes_ok(*dims)

    # ---- the weights' copies -----------------------------------------------------------------
    def prepare_weights(self, params_fp8, layers, wte) -> None:
        """Cast every layer matrix of `layers` and the tied `wte` (the model's params_lp views) into params_fp8,
        both layouts in one pass: the products of the ops then read these instead of casting their weights per
        call. The model calls this whenever it writes params_lp (its load, every AdamW step). Two launches for
        all of them, over a table of the matrices in params_fp8, written by the first eager call for these
        buffers (a graph recording before it casts one matrix at a time instead, to the same bytes). The amax
        pass skips a matrix whose amax the AdamW step before took (adamw_step, weight_amax_rows; a flag beside
        the amax word says so); every amax word and flag is left at zero for the next step. The book keeps the
        last model's views (so that their memory, while in use here, goes to no other array): that model's
        buffers live until another model prepares its own or the engine goes."""
        import cupy

        casts, copies, table, slots = _weight_casts(params_fp8, layers, wte)
        key = (ptr(params_fp8), params_fp8.nbytes, tuple(ptr(W) for W, *_ in casts))
        written = self._table is not None and self._table[0] == key
        if not written and not cupy.cuda.get_current_stream().is_capturing():
            self._table = (key, _write_weight_table(table, casts))
            lo, hi = min(ptr(W) for W, *_ in casts), max(ptr(W) + W.nbytes for W, *_ in casts)
            self._amax_rows = (table[AMAX_ROW_WORD:], len(casts), lo, hi)
            written = True
        if written:
            chunks, grid_cast = self._table[1]
            n, d = np.int32(len(casts)), kernel_defines("fp8")
            self.engine.launch("k_fp8_amax_many", -(-chunks // d["FP8_AMAX_MANY_CHUNKS"]), d["FP8_AMAX_THREADS"],
                               table, n, np.int64(chunks))
            self.engine.launch("k_fp8_cast_many", grid_cast, d["FP8_THREADS"], table, n)
        else:
            for W, rows, cols, cast in casts:
                self.cast(W, rows, cols, "e4m3", **cast, keep=False)
        self._clear_weight_amax(slots)
        self._weights = copies

    def drop_weight_table(self) -> None:
        """A new params_fp8 (zero-filled) holds no table until prepare_weights writes one."""
        self._table = None

    def _clear_weight_amax(self, slots) -> None:
        """Every weight slot's amax word and the flag after it (k_adamw's) back to zero, its descale kept: rows of
        two words a slot apart, as one k_memset (kernels/memset.cu)."""
        n, threads, d = slots.size // SLOT_FLOATS, kernel_defines("memset")["MEMSET_THREADS"], kernel_defines("fp8")
        width = d["FP8_SLOT_TAKEN"] - d["FP8_SLOT_AMAX"] + 1
        self.engine.launch("k_memset", blocks(width * n, threads), threads, np.uint64(ptr(_slot_field(slots, "AMAX"))),
                           np.uint64(slots.itemsize * SLOT_FLOATS), np.uint32(0), np.uint32(slots.itemsize),
                           np.uint64(width), np.uint64(n))

    def weight_amax_rows(self, params_lp) -> tuple:
        """k_adamw's amax arguments (rows, count, stride) for an update that writes params_lp: the rows of the last
        weight table (in its spare words) where its matrices lie in params_lp, so that AdamW takes their amax for
        the casts after it; else none (count 0, and the casts' amax pass runs)."""
        stride = np.int32(_table_words())
        found = self._amax_rows
        if params_lp is None or found is None:
            return np.uint64(0), np.int32(0), stride
        rows, n, lo, hi = found
        if not ptr(params_lp) <= lo < hi <= ptr(params_lp) + params_lp.nbytes:
            return np.uint64(0), np.int32(0), stride
        return rows, np.int32(n), stride

    def weight(self, W, layout: str, rows: int, cols: int, slot: int, *, tied: bool = False, **cast):
        """(FP8 bytes, descale) of a weight: its prepared copy ("forward": transposed, "input_grad": as the input
        gradient reads it; `tied`, wte, whose forward x wte^T reads it as stored and whose input gradient
        transposed), or cast here into the operand scratch `cast["into"]` when it has none."""
        transposed = (layout == "forward") != tied
        if self.prepared(W):
            _, nat, tr, descale = self._weights[W.data.ptr]
            return (tr if transposed else nat), descale
        into = cast.pop("into")
        return into, self.cast(W, rows, cols, "e4m3", slot, **{"qt" if transposed else "q": into}, **cast,
                               keep=False)

    def prepared(self, W) -> bool:
        """Whether W has prepared FP8 copies (prepare_weights)."""
        copy = self._weights.get(W.data.ptr)
        return copy is not None and copy[0].shape == W.shape

    # ---- scratch and scale slots -------------------------------------------------------------
    def operands(self, *sizes: int) -> list:
        """uint8 views of the engine's fp8_operands buffer, one per size, 256-byte aligned, back to back. An
        op run outside a model (whose plan sizes the buffer) gets one sized here on first use."""
        import cupy

        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // ALIGN) * ALIGN
        own = self.engine.own
        buf = own.get("fp8_operands")
        if buf is None or buf.nbytes < total:
            buf = own["fp8_operands"] = cupy.empty(total, dtype=np.uint8)
        return [buf[o:o + n] for o, n in zip(offsets, sizes)]

    def scale_slot(self, i):
        """(amax word, descale) of scale slot i of the engine's fp8_scales, or of a slot array given."""
        slot = i if not isinstance(i, int) else self.engine.own["fp8_scales"][SLOT_FLOATS * i:][:SLOT_FLOATS]
        return _slot_field(slot, "AMAX").view(np.uint32), slot[:1]

    # ---- the pass's amax book ----------------------------------------------------------------
    # Inside open_pass, `kept` maps a tensor (its pointer and bytes) whose amax is current to its slot in the
    # engine's fp8_amax. The rule that keeps it true: every op that writes a tensor either keeps its amax
    # (produced: the LayerNorms, the GELU passes, the bf16 attention) or drops it (wrote); a cast's amax pass keeps
    # it. Each write kept takes the pass's next slot, never one used before in the pass, so that one memset of the
    # whole table as the pass opens zeroes every amax word its producers max into (a memset for each write would
    # leave the recorded step idle around each of them).
    @contextlib.contextmanager
    def open_pass(self, backward: bool = True):
        """One pass of a model over its own buffers (a micro-batch's forward and backward, or with `backward`
        False a forward alone): within it each tensor's amax is found once (module docstring). Outside, every
        cast runs its own amax pass."""
        if self._pass is not None:
            raise RuntimeError("fp8_pass: a pass is already open")
        own = self.engine.own
        if own.get("fp8_amax") is not None:
            self.engine.zero(own["fp8_amax"])
        # fp8_only: the outputs written as FP8 bytes only (bytes_written: the LayerNorms', dqkv, the MLP's act)
        self._pass = {"kept": {}, "slots": 0, "transposed": {}, "backward": backward, "fp8_only": {}}
        try:
            yield
        finally:
            self._pass = None

    @property
    def in_pass(self) -> bool:
        """Whether a pass is open (open_pass)."""
        return self._pass is not None

    def backward_follows(self) -> bool:
        """Whether a backward may read what this forward saves for it: not inside a forward-alone pass."""
        return self._pass is None or self._pass["backward"]

    def wrote(self, *bufs) -> None:
        """An op wrote these without their amax: drop every kept tensor they overlap (and its saved transpose)."""
        if self._pass is None:
            return
        spans = [(ptr(b), b.nbytes) for b in bufs]
        for book in (self._pass["kept"], self._pass["transposed"], self._pass["fp8_only"]):
            for span in spans:
                for key in [k for k in book if overlaps(*span, *k)]:
                    del book[key]

    def bytes_written(self, out, q, qt, descale, rerun, fmt: str) -> None:
        """An op wrote out as FP8 bytes (`fmt`) only: X in q, X^T in qt (None: none), at the descale given, kept for
        the pass's products (a LayerNorm's output, ops/layernorm.py; dqkv, ops/attn.py; the MLP's act on the act
        history's path, ops/mlp.py); `rerun()` writes out in bf16 instead (readable)."""
        key = (ptr(out), out.nbytes)
        self._pass["fp8_only"][key] = (q, descale, rerun, fmt)
        if qt is not None:
            self._pass["transposed"][key] = (qt, descale)

    def bytes_of(self, x, fmt: str) -> tuple | None:
        """(X, descale) where an op wrote x as `fmt` bytes only in this pass (bytes_written), else None."""
        written = None if self._pass is None else self._pass["fp8_only"].get((ptr(x), x.nbytes))
        if written is None:
            return None
        if written[3] != fmt:
            raise RuntimeError(f"{fmt} bytes of a tensor written as {written[3]}")
        return written[0], written[1]

    def readable(self, *xs) -> None:
        """Every x of xs that its op wrote as FP8 bytes only gets its bf16 values: the op runs again (a LayerNorm from
        its input, mean and rstd; the attention backward from its inputs: the same bits as ever; the MLP's act as
        GELU(pre), from the bf16 pre its product wrote beside it), dropping the bytes.
        Whatever reads x as bf16 in a pass calls this first: a product with no FP8 algorithm, a cast."""
        if self._pass is None:
            return
        for x in xs:
            written = self._pass["fp8_only"].get((ptr(x), x.nbytes))
            if written is not None:
                self.wrote(x)  # its bytes, X^T with them, are overwritten
                written[2]()

    def history_transpose(self, q, qt, rows: int, cols: int, row, fold: str | None) -> None:
        """k_fp8_act_t: a history's tensor's FP8 bytes q [rows, cols] transposed into qt (None: not written), and with
        `fold` (its format) the pass folded into its history row first."""
        grid = act_t_grid(rows, cols) if qt is not None else (1, 1)
        self.engine.k["k_fp8_act_t"](grid, (kernel_defines("fp8")["FP8_THREADS"],), (
            q, np.uint64(0) if qt is None else qt, np.int32(rows), np.int32(cols), row,
            np.int32(FORMATS[fold][0] if fold else 0)))

    def _transpose_place(self, x):
        """x's place in fp8_act_t (its E4M3 transpose, kept from a forward's cast to the backward), assigned on
        first sight and kept while the engine holds that buffer (a larger plan's replaces it); None outside a
        pass, in a forward-alone pass, without the buffer or with every place taken (the backward then casts x
        again). A place is written and read within one pass, so models taking turns on the engine may share one."""
        held = self.engine.own.get("fp8_act_t")
        if self._pass is None or not self.backward_follows() or held is None:
            return None
        places, key = self._act_t_places, (ptr(held), ptr(x), x.nbytes)
        if key not in places:
            at = sum(_padded(n) for (h, _, _), (_, n) in places.items() if h == ptr(held))
            if at + x.size > held.size:
                return None
            places[key] = (at, x.size)  # x.size bytes: an E4M3 byte an element
        at, n = places[key]
        return held[at:at + n]

    def saved_transpose(self, x):
        """(x^T in E4M3, its descale) as this pass's forward cast it, or None: x since rewritten, or never saved."""
        return None if self._pass is None else self._pass["transposed"].get((ptr(x), x.nbytes))

    def _keep(self, x):
        """x's slot array in fp8_amax (the pass's next, zeroed as the pass opened), x now kept (what overlapped it
        dropped); None outside a pass or when the pass has no slot left (its casts then run their own passes)."""
        if self._pass is None:
            return None
        self.wrote(x)
        i = self.next_slot()
        if i is None:
            return None
        self._pass["kept"][(ptr(x), x.nbytes)] = i
        return self.amax_slot(i)

    def next_slot(self) -> int | None:
        """The index of the pass's next slot (zero since the pass opened), now taken; None outside a pass or with
        none left."""
        table = self.engine.own.get("fp8_amax")
        if self._pass is None or table is None or self._pass["slots"] >= table.size // SLOT_FLOATS:
            return None
        self._pass["slots"] += 1
        return self._pass["slots"] - 1

    def amax_slot(self, i: int):
        """Slot i of the pass's table fp8_amax (laid out as fp8_scales' slots: scale_slot reads either)."""
        return self.engine.own["fp8_amax"][SLOT_FLOATS * i:][:SLOT_FLOATS]

    def produced(self, out):
        """The amax word (zero) into which a producer kernel writes out's amax as it stores out, kept for out's
        casts; None outside a pass or with no slot left (the kernel then gets a null pointer, `amax_arg`, and
        computes none)."""
        slot = self._keep(out)  # drops what out overlapped, kept or not
        if slot is None:
            return None
        amax, _ = self.scale_slot(slot)
        return amax

    # ---- casts and products ------------------------------------------------------------------
    def cast(self, x, rows: int, cols: int, fmt: str, slot, *, q=None, ldq=None, q_batch=0, qt=None, ldqt=None,
             qt_batch=0, batch: int = 1, keep: bool = True):
        """Cast x [batch, rows, cols] to FP8 with its own scale: into q (row-major, leading dimension ldq,
        batch z at z * q_batch) and/or qt (its transpose [cols, rows] per batch, leading dimension ldqt);
        returns the device descale 1 / s that the product takes. In a pass the amax comes from x's slot where it
        is kept, else its amax pass runs into a new slot of the pass (kept for x's later casts with `keep`), or
        outside one into scale slot `slot` (an engine slot's index, or a slot array of the caller's own, which a
        pass leaves to the caller: a weight's copy keeps its descale there)."""
        self.readable(x)
        book = self._pass
        known = book["kept"].get((ptr(x), x.nbytes)) if book is not None else None
        if known is not None:
            amax, descale = self.scale_slot(self.amax_slot(known))
        else:
            if keep:
                mine = self._keep(x)
            else:
                i = self.next_slot() if isinstance(slot, int) else None
                mine = None if i is None else self.amax_slot(i)
            amax, descale = self.scale_slot(slot if mine is None else mine)
            n = batch * rows * cols
            threads = kernel_defines("fp8")["FP8_AMAX_THREADS"]
            if mine is None:  # a slot of the pass is zero already
                self.engine.zero(amax)
            # 8 activations a thread a pass; a few blocks an SM are enough to stream it (the max needs no order)
            self.engine.launch("k_fp8_amax", min(blocks(n, 8 * threads), AMAX_BLOCKS), threads, amax, x, np.int64(n))
        tile = kernel_defines("fp8")["FP8_TILE"]
        grid = (-(-cols // tile), -(-rows // tile), batch)
        null = np.uint64(0)
        self.engine.k["k_fp8_cast"](grid, (kernel_defines("fp8")["FP8_THREADS"],), (
            null if q is None else q, np.int64(ldq or cols), np.int64(q_batch),
            null if qt is None else qt, np.int64(ldqt or rows), np.int64(qt_batch),
            descale, amax, x, np.int32(rows), np.int32(cols), np.int32(fmt == "e5m2")))
        return descale

    def cast_saving(self, x, rows: int, cols: int, q, save: bool) -> tuple:
        """(x [rows, cols] in E4M3, its descale): the bytes its LayerNorm wrote (bytes_written, x^T saved too), or x
        cast into q as `cast` does; with `save`, x^T too, into x's place in fp8_act_t, kept for the backward
        (saved_transpose) where x has a place and its amax a slot of the pass (the descale is then the slot's,
        current until x is rewritten)."""
        written = self.bytes_of(x, "e4m3")
        if written is not None:
            return written
        key = (ptr(x), x.nbytes)
        xt = self._transpose_place(x) if save else None
        sx = self.cast(x, rows, cols, "e4m3", 0, q=q, qt=xt)
        if xt is not None and key in self._pass["kept"]:
            self._pass["transposed"][key] = (xt, sx)
        return q, sx

    def transpose(self, x, rows: int, cols: int, qt) -> tuple:
        """(x^T in E4M3, its descale): the forward's where it saved it, else x [rows, cols] cast into qt."""
        saved = self.saved_transpose(x)
        return saved if saved is not None else (qt, self.cast(x, rows, cols, "e4m3", 0, qt=qt))

    def linear_fwd(self, out, inp, W, N, K, M, save_transpose: bool = False, **kw) -> bool:
        """out [N, M] = inp [N, K] @ W [K, M] on FP8 operands (X, and W^T [M, K]); False: nothing written.
        `save_transpose`: X^T too, kept for the backward (cast_saving)."""
        xq, wt = self.operands(N * K, K * M)
        xq, sx = self.cast_saving(inp, N, K, xq, save_transpose)
        return self.times_weight(out, xq, sx, W, N, K, M, into=wt, **kw)

    def times_weight(self, out, xq, sx, W, N, K, M, into, **kw) -> bool:
        """out [N, M] = X @ W from X's E4M3 bytes xq [N, K] (device descale sx) and W's forward copy (cast into
        `into`, operand scratch of K * M bytes, where W has none); False: nothing written."""
        wt, sw = self.weight(W, "forward", K, M, 1, into=into)
        return self.gemm(out, xq, sx, "e4m3", wt, sw, "e4m3", N, M, K, fast=True, **kw)

    def linear_bwd(self, dinp, dW, dout, inp, W, N, K, M, beta: float, cast=None, beta_w: float = 1.0) -> tuple:
        """dW [K, M] = inp^T @ dout + beta_w * dW and dinp [N, K] = dout [N, M] @ W^T (+ beta * dinp) on FP8
        operands: inp^T (the forward's where it saved it) and dout^T for the first, dout and W as stored for the
        second. `cast`: cast(dq, dt) writes dout's E5M2 layouts and returns their descale, in place of dout's own
        cast (the MLP's dgelu cast, which finishes dout too). Which ran, and the descales of dout and W (device
        words)."""
        xt, dt, dq, w = self.operands(N * K, N * M, N * M, K * M)
        xt, sx = self.transpose(inp, N, K, xt)
        sd = cast(dq, dt) if cast is not None else self.cast(dout, N, M, "e5m2", 1, q=dq, qt=dt)
        w, sw = self.weight(W, "input_grad", K, M, 2, into=w)
        return (self.gemm(dW, xt, sx, "e4m3", dt, sd, "e5m2", K, M, N, beta=beta_w),
                self.gemm(dinp, dq, sd, "e5m2", w, sw, "e4m3", N, K, M, beta=beta), sd, sw)

    def gemm(self, c, a, a_scale, a_fmt, b, b_scale, b_fmt, m, n, k, *, fast: bool = False, **kw) -> bool:
        """Row-major C[m, n] = (a_scale * A[m, k]) @ (b_scale * B[n, k])^T (+ beta * C, an epilogue, a batch)
        on FP8 operands; False where cuBLASLt has no algorithm (nothing ran). `fast`: fast accumulation, for the
        forward products (module docstring)."""
        return self.engine.blas_lt.gemm(c, a, b, m, n, k, trans_b=True, a_type=a_fmt, b_type=b_fmt, a_scale=a_scale,
                                        b_scale=b_scale, fast_accum=fast, **kw)


def _weight_casts(params_fp8, layers, wte) -> tuple:
    """(casts, copies, table, slots) of Fp8Book.prepare_weights: each matrix's cast into params_fp8 as (W, rows,
    cols, Fp8Book.cast's keywords), its copies as the book keeps them, and the int64 table and float32 scale slots
    at params_fp8's end (weight_bytes)."""
    at, casts, copies = 0, [], {}
    matrices = [(w[name], name) for w in layers for name, _ in WEIGHTS] + [(wte, "wte")]
    slots_at = params_fp8.nbytes - len(matrices) * SLOT_FLOATS * 4
    table = params_fp8[slots_at - len(matrices) * _table_words() * 8:slots_at].view(np.int64)
    slots = params_fp8[slots_at:].view(np.float32)
    for j, (W, name) in enumerate(matrices):
        padded = _padded(W.size)
        nat, tr = params_fp8[at:at + W.size], params_fp8[at + padded:at + padded + W.size]
        at += 2 * padded
        slot = slots[j * SLOT_FLOATS:][:SLOT_FLOATS]
        if name == "W_QKV":  # forward: each W_i^T; input gradient: [W_0 W_1 W_2] as [C, 3C]
            C = W.shape[-1]
            casts.append((W, C, C, dict(slot=slot, q=nat, ldq=3 * C, q_batch=C, qt=tr, qt_batch=C * C, batch=3)))
        else:
            casts.append((W, W.shape[0], W.shape[1], dict(slot=slot, q=nat, qt=tr)))
        copies[W.data.ptr] = (W, nat, tr, slot[:1])
    return casts, copies, table, slots


def _write_weight_table(table, casts) -> tuple[int, int]:
    """Upload k_fp8_amax_many / k_fp8_cast_many's table of these casts (kernels/fp8.cu); its amax chunks and cast
    tiles in all. Each row's spare words (from AMAX_ROW_WORD) hold, for the matrices sorted by address, the k-th's
    bytes [start, end) and the address of its amax word: the ranges k_adamw takes the amax of (kernels/adamw.cu)."""
    d = kernel_defines("fp8")
    rows_out = np.zeros((len(casts), d["FP8_TABLE_WORDS"]), dtype=np.int64)
    chunks_at = tiles_at = 0
    for i, (W, rows, cols, c) in enumerate(casts):
        batch = c.get("batch", 1)
        rows_out[i, :AMAX_ROW_WORD] = (ptr(W), rows, cols, batch, ptr(c["q"]), c.get("ldq") or cols,
                                       c.get("q_batch", 0), ptr(c["qt"]), c.get("ldqt") or rows, c.get("qt_batch", 0),
                                       ptr(c["slot"]), chunks_at, tiles_at)
        chunks_at += -(-batch * rows * cols // d["FP8_MANY_CHUNK"])
        tiles_at += -(-cols // d["FP8_TILE"]) * -(-rows // d["FP8_TILE"]) * batch
    by_address = sorted(casts, key=lambda cast: ptr(cast[0]))
    for k, (W, *_, c) in enumerate(by_address):
        rows_out[k, AMAX_ROW_WORD:AMAX_ROW_WORD + 3] = (ptr(W), ptr(W) + W.nbytes, ptr(_slot_field(c["slot"], "AMAX")))
    table.set(rows_out.reshape(-1))
    return chunks_at, tiles_at


def _slot_field(slot, name: str):
    """The one-float view of a scale slot's field (kernels/fp8.cu's FP8_SLOT_<NAME>: AMAX, TAKEN)."""
    at = kernel_defines("fp8")[f"FP8_SLOT_{name}"]
    return slot[at:at + 1]


def fp8_halves(x) -> tuple:
    """x's bytes (a contiguous 16-bit [rows, cols]) as two uint8 [rows * cols] halves, X and X^T in FP8: where an op
    writes its output in both FP8 layouts in that output's own memory (the MLP's act under the act history, the
    layers' LayerNorm outputs, dqkv under the dqkv history)."""
    b = x.reshape(-1).view(np.uint8)
    half = b.size // 2
    return b[:half], b[half:]


def amax_arg(amax):
    """A kernel's amax argument: the word, or a null pointer for None."""
    return np.uint64(0) if amax is None else amax


def fp8_shapes_ok(*dims: int) -> bool:
    """Whether every dimension of a product suits cuBLASLt's FP8 kernels (multiples of 16)."""
    return all(d % 16 == 0 for d in dims)
