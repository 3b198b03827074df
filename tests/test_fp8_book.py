"""The CUDA engine's FP8 book (andrea/ops/fp8.py, Fp8Book) on the host, a device array stood for by its pointer
and size: the amaxes a pass keeps and what drops them, its slots, the bytes a LayerNorm wrote as E4M3 and the places
of the saved transposes; and the FP8 buffers a model's plan adds for the book."""

import numpy as np
import pytest

from andrea.ops import fp8


class _Array:
    """What the amax book reads of a device array: its pointer and size (bf16 elements)."""

    def __init__(self, at: int, nbytes: int):
        self.data = type("Memory", (), {"ptr": at})()
        self.nbytes = nbytes
        self.size = nbytes // 2


class _Held(_Array):
    """A uint8 buffer whose slices are (start, stop): where a place lies in it."""

    def __init__(self, at: int, nbytes: int):
        super().__init__(at, nbytes)
        self.size = nbytes

    def __getitem__(self, s: slice):
        return (s.start, s.stop)


class _Engine:
    """What an Fp8Book reads of its engine, on the host: the pass's slot table a NumPy array, zero() a fill."""

    def __init__(self, slots: int):
        self.own = {"fp8_amax": np.full(fp8.SLOT_FLOATS * slots, 7.0, dtype=np.float32)}

    def zero(self, buf):  # only the book's own amax words here
        buf[...] = 0


def _book(slots: int) -> fp8.Fp8Book:
    return fp8.Fp8Book(_Engine(slots))


def _kept(book):
    return sorted(book._pass["kept"])


def test_the_amax_book_keeps_a_tensor_until_something_writes_over_it():
    """In a pass a produced tensor is kept (in a slot zeroed as the pass opened); a write overlapping it, from any
    side, drops it; writes beside it do not; outside a pass nothing is kept and producers get no slot."""
    book = _book(slots=8)
    a, b = _Array(0, 256), _Array(256, 256)
    assert book.produced(a) is None and book._pass is None
    with book.open_pass():
        amax_a = book.produced(a)
        assert amax_a is not None and amax_a.dtype == np.uint32 and int(amax_a[0]) == 0
        book.produced(b)
        assert _kept(book) == [(0, 256), (256, 256)]
        book.wrote(_Array(512, 64))  # beside both
        assert len(_kept(book)) == 2
        book.wrote(_Array(255, 2))  # one byte into each
        assert _kept(book) == []
        book.produced(a)
        book.wrote(_Array(100, 8))  # inside a
        assert _kept(book) == []
        # a write takes the pass's next slot, never one used before in it: zero since the pass opened
        before = book.engine.own["fp8_amax"].copy()
        amax_a = book.produced(a)
        assert book._pass["kept"][(0, 256)] == 3 and int(amax_a[0]) == 0
        np.testing.assert_array_equal(book.engine.own["fp8_amax"], before)  # no word written: no memset a write
        with pytest.raises(RuntimeError):
            with book.open_pass():
                pass
    assert book._pass is None


def test_the_amax_book_falls_back_when_its_slots_run_out():
    """A pass with more tensors than slots keeps what fits; the rest get no slot (their casts run their own
    amax passes) and a new tensor over an old one still drops the old."""
    book = _book(slots=2)
    with book.open_pass():
        assert book.produced(_Array(0, 16)) is not None
        assert book.produced(_Array(16, 16)) is not None
        assert book.produced(_Array(32, 16)) is None
        assert book.produced(_Array(8, 16)) is None  # over both kept ones
        assert _kept(book) == []
    with book.open_pass():  # a new pass starts with every slot free
        assert book.produced(_Array(32, 16)) is not None


def test_a_cast_in_a_pass_zeroes_no_amax_word_of_its_own():
    """In a pass a cast whose tensor has no kept amax runs its amax pass into the pass's next slot (zero since the
    pass opened), kept (`keep`) or not; outside a pass, or with a slot of the caller's own (a weight copy's, which
    keeps its descale there), into that slot, zeroed first."""
    book = _book(slots=4)
    book.engine.own["fp8_scales"] = np.full(fp8.SLOT_FLOATS * fp8.SCALE_SLOTS, 7.0, dtype=np.float32)
    launched = []
    book.engine.launch = lambda name, grid, threads, amax, *a: launched.append((name, amax))
    book.engine.k = {"k_fp8_cast": lambda grid, block, args: launched.append(("k_fp8_cast", args[6]))}
    zeroed = []
    book.engine.zero = lambda buf: (zeroed.append(buf.size), buf.fill(0))
    own_slot = np.full(fp8.SLOT_FLOATS, 7.0, dtype=np.float32)
    with book.open_pass():
        zeroed.clear()  # the table, as the pass opened
        for keep in (True, False):
            book.cast(_Array(1024 * keep, 512), 16, 16, "e4m3", 0, keep=keep)
        assert zeroed == [] and book._pass["slots"] == 2
        assert [k for k in book._pass["kept"]] == [(1024, 512)]  # only the kept cast's tensor
        # its amax word and descale: slot 1 of the pass's table (not the engine's scale slot 0)
        assert launched[2][1].base is book.engine.own["fp8_amax"] or np.shares_memory(launched[2][1], book.engine.own["fp8_amax"])
        book.cast(_Array(4096, 512), 16, 16, "e4m3", own_slot, keep=False)
        assert zeroed == [1] and np.shares_memory(launched[-1][1], own_slot)
    zeroed.clear()
    book.cast(_Array(0, 512), 16, 16, "e4m3", 0, keep=False)
    assert zeroed == [1] and np.shares_memory(launched[-2][1], book.engine.own["fp8_scales"])


def test_a_layernorm_s_e4m3_bytes_serve_the_products_until_its_output_is_written_or_read_as_bf16():
    """In a pass the bytes a LayerNorm wrote as E4M3 (bytes_written) are what the products take, X and X^T with
    the LayerNorm's descale, in place of casts; a write over the output drops them; a read of it as bf16
    (readable, and any cast of it) has the LayerNorm run again, once, and drops them. A forward alone has no
    X^T; outside a pass nothing is kept."""
    book = _book(slots=4)
    book.engine.own["fp8_scales"] = np.zeros(fp8.SLOT_FLOATS * fp8.SCALE_SLOTS, dtype=np.float32)
    book.engine.launch = lambda *a: None
    book.engine.k = {"k_fp8_cast": lambda grid, block, args: None}
    out, reruns = _Array(0, 512), []

    def written(qt="XT"):
        book.bytes_written(out, "X", qt, "descale", lambda: reruns.append(len(reruns)), "e4m3")

    with book.open_pass():
        written()
        assert book.cast_saving(out, 16, 16, "scratch", True) == ("X", "descale")
        assert book.transpose(out, 16, 16, "scratch") == ("XT", "descale")
        book.readable(_Array(512, 512))  # another tensor: nothing to run
        assert reruns == []
        book.readable(out)
        book.readable(out)
        assert reruns == [0] and book.saved_transpose(out) is None
        written()
        book.wrote(_Array(500, 64))  # over its end
        book.readable(out)
        assert reruns == [0] and book.saved_transpose(out) is None
        written()
        assert book.cast_saving(out, 16, 16, "scratch", False) == ("X", "descale")
        book.cast(out, 16, 16, "e4m3", 0)  # a cast reads out as bf16
        assert reruns == [0, 1] and book.saved_transpose(out) is None
    with book.open_pass(backward=False):
        written(qt=None)
        assert book.saved_transpose(out) is None
        assert book.cast_saving(out, 16, 16, "scratch", False) == ("X", "descale")
    book.readable(out)  # outside a pass
    assert reruns == [0, 1]


def test_each_kept_act_gets_a_place_of_its_own_in_fp8_act_t():
    """Inside a pass each act gets a 256-byte aligned place of one byte an element, the same one each time,
    beside the others'; none outside a pass or once the buffer is full; a new buffer starts its places again.
    A saved transpose is dropped by any write over its tensor."""
    book = _book(slots=8)
    book.engine.own["fp8_act_t"] = _Held(10_000, 3 * 512)
    a, b, c = _Array(0, 1000), _Array(1024, 1000), _Array(4096, 1000)  # 500 elements each
    assert book._transpose_place(a) is None
    with book.open_pass():
        assert [book._transpose_place(x) for x in (a, b, c)] == [(0, 500), (512, 1012), (1024, 1524)]
        assert book._transpose_place(b) == (512, 1012)
        assert book._transpose_place(_Array(8192, 1000)) is None  # 1536 + 500 > 1536
        book._pass["transposed"][(0, 1000)] = ("a^T", "descale")
        assert book.saved_transpose(a) == ("a^T", "descale") and book.saved_transpose(b) is None
        book.wrote(_Array(998, 4))  # its last byte
        assert book.saved_transpose(a) is None
    assert book.saved_transpose(a) is None
    book.engine.own["fp8_act_t"] = _Held(20_000, 4 * 512)
    with book.open_pass():
        assert book._transpose_place(c) == (0, 500)


def test_the_scratch_holds_every_op_s_operands():
    """operand_bytes is mlp_bwd's need; attn_qkv_bwd's and the forward products' are smaller at any shape."""
    for B, T, C in ((1, 16, 16), (8, 1024, 768), (32, 512, 384), (4, 64, 64)):
        N, F = B * T, 4 * C
        need = {"attn_qkv_bwd": 7 * N * C + 3 * C * C, "mlp_bwd": N * C + 2 * N * F + C * F,
                "mlp_fwd": N * F + F * C}
        assert max(need.values()) <= fp8.operand_bytes(B, T, C)


def test_a_plan_gives_each_layer_s_kept_tensors_a_slot():
    """amax_slots covers what a model's pass keeps: 3 a layer (two LayerNorm outputs, the GELU output; a fourth
    to spare) and the shared buffers."""
    by_name = {b.name: b for b in fp8.plan_buffers(8, 1024, 768, 12, 50304)}
    assert by_name["fp8_amax"].shape == (fp8.SLOT_FLOATS * fp8.amax_slots(12),)
    assert by_name["fp8_amax"].role == "engine"
    assert fp8.amax_slots(12) >= 4 * 12 + 5


def test_a_training_plan_holds_act_t_for_each_layer_that_keeps_its_act():
    """fp8_act_t: one 256-byte aligned [4C, N] E4M3 place for each layer whose MLP act the backward reads as saved
    and one [C, N] for each LayerNorm output whose transpose the forward saves; none for a forward-only plan or
    where nothing is kept."""
    B, T, C = 3, 50, 36
    place, ln_place = (-(-B * T * k * C // fp8.ALIGN) * fp8.ALIGN for k in (4, 1))
    by_name = {b.name: b for b in fp8.plan_buffers(B, T, C, 3, 301, loss_rows=B * T, kept_acts=2)}
    assert by_name["fp8_act_t"].shape == (2 * place,) and by_name["fp8_act_t"].role == "engine"
    assert place > B * T * 4 * C and ln_place > B * T * C  # the padding is there: the places do not simply touch
    both = {b.name: b for b in fp8.plan_buffers(B, T, C, 3, 301, loss_rows=B * T, kept_acts=2, kept_lns=5)}
    assert both["fp8_act_t"].shape == (2 * place + 5 * ln_place,)
    lns = {b.name: b for b in fp8.plan_buffers(B, T, C, 3, 301, loss_rows=B * T, kept_lns=6)}
    assert lns["fp8_act_t"].shape == (6 * ln_place,)
    assert "fp8_act_t" not in {b.name for b in fp8.plan_buffers(B, T, C, 3, 301, kept_acts=2, kept_lns=6)}
    assert "fp8_act_t" not in {b.name for b in fp8.plan_buffers(B, T, C, 3, 301, loss_rows=B * T)}
