"""The cuBLASLt algorithm table (andrea/engines/cublas.py): which table a GPU reads, which algorithm a product
takes, and that the committed table agrees with its own measurements."""

import json
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from andrea.engines.cublas import (ALGORITHMS_FILE, Cublas, CublasLt, algorithm_table, baseline_ms, chosen_key,
                                   merged_tables, product_name)

# a plan key as CublasLt.plan_for makes it: types, m, n, k, transposes, epilogue, FP8 accumulation (None: not
# FP8), algorithm, batch and strides, then the four alignments
GELU_AUX = ("bfloat16", "bfloat16", "bfloat16", 16384, 1536, 384, False, False, "gelu_aux", None, None, (1, 0, 0, 0),
            256, 256, 256, 256)


def _with(key, epilogue):
    return (*key[:8], epilogue, *key[9:])


def test_a_gpu_reads_only_the_table_made_on_it():
    tables = [{"device": "NVIDIA H200", "cublaslt": 120900, "choices": {"p": 3}},
              {"device": "NVIDIA H100", "cublaslt": 120900, "choices": {"p": 1}}]
    assert algorithm_table(tables, "NVIDIA H200", 120900) == {"p": 3}
    assert algorithm_table(tables, "NVIDIA H100", 120900) == {"p": 1}
    assert algorithm_table(tables, "NVIDIA H200", 120800) == {}  # another cuBLASLt: its heuristic's list may differ


def test_a_product_takes_the_table_s_algorithm_unless_one_is_asked_for():
    choices = {product_name(GELU_AUX): 4}
    assert chosen_key(GELU_AUX, None, choices)[10] == 4
    assert chosen_key(GELU_AUX, 0, choices)[10] == 0  # an explicit index is that index (the tuner's sweep)
    assert chosen_key(GELU_AUX, 2, choices)[10] == 2
    assert chosen_key(_with(GELU_AUX, "gelu"), None, choices)[10] == 4  # runs on gelu_aux's algorithm
    assert chosen_key(_with(GELU_AUX, "dgelu"), None, choices)[10] == 0  # not in the table: the heuristic's first
    other = (*GELU_AUX[:3], 8192, *GELU_AUX[4:])
    assert chosen_key(other, None, choices)[10] == 0
    assert product_name(chosen_key(GELU_AUX, None, choices)) == product_name(GELU_AUX)


def test_new_measurements_replace_their_products_and_keep_the_others():
    h200 = {"device": "NVIDIA H200", "cublaslt": 1, "margin": 0.03, "choices": {"a": 2, "b": 1},
            "measured_ms": {"a": [1.0, 0.9, 0.5], "b": [1.0, 0.5], "c": [1.0, 0.99], "p": [0.8]},
            "baseline_ms": {"p": 1.0}}
    h100 = {"device": "NVIDIA H100", "cublaslt": 1, "margin": 0.03, "choices": {"a": 1}, "measured_ms": {"a": [1, 0.5]}}
    tables = merged_tables([h100, h200], "NVIDIA H200", 1, 0.03, {"c": 1, "q": 0}, {"b": [1.0, 0.99], "c": [1.0, 0.5],
                           "q": [0.5, 0.6]}, {"q": 0.9})
    assert tables[0] == h100
    assert tables[1]["choices"] == {"a": 2, "c": 1, "q": 0}  # b measured again without a faster one: no choice now
    assert tables[1]["measured_ms"] == {"a": [1.0, 0.9, 0.5], "b": [1.0, 0.99], "c": [1.0, 0.5], "p": [0.8],
                                        "q": [0.5, 0.6]}
    assert tables[1]["baseline_ms"] == {"p": 1.0, "q": 0.9}  # plain products' cublasGemmEx ms, kept and added
    assert baseline_ms(tables[1], "q") == 0.9 and baseline_ms(tables[1], "c") == 1.0  # else the heuristic's first
    again = merged_tables(tables, "NVIDIA H200", 1, 0.1, {}, {"c": [1.0, 0.95]})  # another margin: a new table
    assert again[1] == {"device": "NVIDIA H200", "cublaslt": 1, "margin": 0.1, "choices": {},
                        "measured_ms": {"c": [1.0, 0.95]}, "baseline_ms": {}}
    assert merged_tables([], "NVIDIA H200", 2, 0.03, {"a": 1}, {"a": [1, 0.5]})[0]["choices"] == {"a": 1}
    remeasured = merged_tables(tables, "NVIDIA H200", 1, 0.03, {}, {"p": [0.99]}, {})
    assert "p" not in remeasured[1]["baseline_ms"]  # measured again as a cuBLASLt product: its old baseline goes


def test_the_committed_table_chooses_what_it_measured():
    if not ALGORITHMS_FILE.is_file():
        pytest.skip("no algorithm table committed")
    for table in json.loads(ALGORITHMS_FILE.read_text())["tables"]:
        assert {"device", "cublaslt", "margin", "choices", "measured_ms"} <= table.keys()
        assert set(table.get("baseline_ms", {})) <= set(table["measured_ms"])
        for name, index in table["choices"].items():
            times = table["measured_ms"][name]
            assert index == min(range(len(times)), key=times.__getitem__), name
            assert times[index] < (1 - table["margin"]) * baseline_ms(table, name), name
        for name, times in table["measured_ms"].items():
            if name not in table["choices"] and times:
                assert min(times) >= (1 - table["margin"]) * baseline_ms(table, name), name


def _array(shape_dtype, ptr):
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr), dtype=np.dtype(shape_dtype))


BF16 = ml_dtypes.bfloat16


def test_a_plain_product_is_tabled_under_the_name_the_tuner_gives_it():
    lt = object.__new__(CublasLt)  # no library: the table lookup alone
    lt._tabled = {}
    c, a, b = _array(BF16, 1 << 20), _array(BF16, 2 << 20), _array(BF16, 3 << 20)
    key = CublasLt.plan_key(c, a, b, 8192, 768, 768, trans_b=True)
    lt.choices = {product_name(key): 1}
    assert product_name(key) == repr(("bfloat16", "bfloat16", "bfloat16", 8192, 768, 768, False, True, "none", None,
                                      (1, 0, 0, 0), 256, 256, 256, 256))
    assert lt.tabled(c, a, b, 8192, 768, 768, trans_b=True)
    assert not lt.tabled(c, a, b, 8192, 768, 768)  # another transpose: another product
    assert not lt.tabled(c, a, b, 8192, 768, 768, trans_b=True, batch=3, stride_b=768 * 768)
    assert not lt.tabled(_array(np.float32, 1 << 20), a, b, 8192, 768, 768, trans_b=True)  # FP32 output
    assert not lt.tabled(c, _array(BF16, (2 << 20) + 64), b, 8192, 768, 768, trans_b=True)  # another alignment class
    assert not lt.tabled(c, a, b, 8192, 768, 768, trans_b=True, ldb=2304)  # leading dimensions of its own


def test_a_product_s_own_leading_dimensions_name_it_and_reach_its_plan():
    """qkv's weight gradient reads dQ, dK and dV as column blocks of one [N, 3C] matrix (ldb 3C, stride_b C): its
    name carries the leading dimensions, a packed product's does not, and the plan's layouts take them."""
    c, a, b = _array(np.float32, 1 << 20), _array(BF16, 2 << 20), _array(BF16, 3 << 20)
    kw = dict(trans_a=True, batch=3, stride_b=768, stride_c=768 * 768)
    packed = CublasLt.plan_key(c, a, b, 768, 768, 8192, **kw)
    own = CublasLt.plan_key(c, a, b, 768, 768, 8192, ldb=2304, **kw)
    assert packed[11] == (3, 0, 768, 589824) and own[11] == (3, 0, 768, 589824, 0, 2304, 0)
    assert product_name(packed) != product_name(own)
    assert CublasLt.plan_key(c, a, b, 768, 768, 8192, lda=None, ldb=None, ldc=None, **kw) == packed
    lt = object.__new__(CublasLt)  # no library: record the layouts _plan asks for, stop before the heuristic
    lt._plans, layouts = {}, []
    lt._set = lambda desc, attr, value: None
    lt._layout = lambda dtype, rows, cols, ld, batch=1, stride=0: layouts.append((dtype, rows, cols, ld, batch, stride))

    class Stop(Exception):
        pass

    def stop(*_):
        raise Stop

    lt.lib = SimpleNamespace(cublasLtMatmulDescCreate=lambda *_: 0, cublasLtMatmulPreferenceCreate=stop)
    for key, ldb in ((own, 2304), (packed, 768)):
        layouts.clear()
        with pytest.raises(Stop):
            lt._plan(key, None)
        # cuBLAS's A is our B ([N, 3C] read as 768 x 8192, ldb), its B our A (inp^T: 768 x 8192, ld 768), D 768 x 768
        assert layouts == [("bfloat16", 768, 8192, ldb, 3, 768), ("bfloat16", 768, 8192, 768, 3, 0),
                           ("float32", 768, 768, 768, 3, 589824)], key


class _FakeLt:
    def __init__(self, tabled: bool, runs: bool):
        self._tabled, self._runs, self.calls = tabled, runs, []

    def tabled(self, *args, **kw):
        return self._tabled

    def gemm(self, *args, **kw):
        self.calls.append((args, kw))
        return self._runs


@pytest.mark.parametrize("tabled, runs, ld, through_lt, through_ex", [
    (True, True, None, 1, 0),  # named in the table: cuBLASLt, on the table's algorithm
    (False, True, None, 0, 1),  # not named: cublasGemmEx
    (True, False, None, 1, 1),  # cuBLASLt has no plan for it after all: cublasGemmEx
    (True, True, 4096, 1, 0),  # leading dimensions of its own, named in the table: cuBLASLt, which takes them
    (False, True, 4096, 0, 1),
])
def test_cublas_runs_a_product_the_table_names_through_cublaslt(tabled, runs, ld, through_lt, through_ex):
    blas = object.__new__(Cublas)
    blas.lt = _FakeLt(tabled, runs)
    ex = []
    blas.gemm_ex = lambda *args, **kw: ex.append((args, kw))
    blas.gemm("c", "a", "b", 8, 4, 2, trans_b=True, ldb=ld, alpha=0.5, beta=1.0)
    assert (len(blas.lt.calls), len(ex)) == (through_lt, through_ex)
    if through_lt:
        assert blas.lt.calls[0] == (("c", "a", "b", 8, 4, 2), dict(trans_a=False, trans_b=True, batch=1, stride_a=0,
                                                                      stride_b=0, stride_c=0, lda=None, ldb=ld,
                                                                      ldc=None, alpha=0.5, beta=1.0))
    if through_ex:
        assert ex[0][1]["ldb"] == ld and ex[0][1]["beta"] == 1.0
    blas.lt = None  # a build without cuBLASLt (fp32, tf32): cublasGemmEx always
    blas.gemm("c", "a", "b", 8, 4, 2)
    assert len(ex) == through_ex + 1


def _plain_products(table: dict) -> list[tuple]:
    """The plain products (cublasGemmEx's unless tabled) a table names: their plan keys without the algorithm."""
    import ast

    return [ast.literal_eval(name) for name in table.get("baseline_ms", {}) if name in table["choices"]]


@pytest.mark.gpu
def test_a_tabled_plain_product_through_cublaslt_matches_cublasgemmex():
    """Every plain product this GPU's table sends to cuBLASLt, on fresh random operands at its shape: the same
    product as cublasGemmEx's to the output type's rounding (only the order of the sums differs)."""
    import cupy

    from andrea.engines.cuda_engine import CudaEngine

    engine = CudaEngine(precision="bf16")
    blas, lt = engine.blas, engine.blas_lt
    table = next((t for t in json.loads(ALGORITHMS_FILE.read_text())["tables"]
                  if (t["device"], t["cublaslt"]) == (lt.device, lt.version)), None)
    if table is None or not _plain_products(table):
        pytest.skip(f"the table names no plain product on {lt.device}, cuBLASLt {lt.version}")
    rng = np.random.default_rng()
    for key in _plain_products(table):
        t_c, t_ab, _, m, n, k, trans_a, trans_b, _, _, (batch, stride_a, stride_b, stride_c, *lds) = key[:11]
        lda, ldb, ldc = lds or (0, 0, 0)  # 0: packed
        dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}

        def operand(rows, cols, ld, stride, t, scale):
            """A flat buffer holding `batch` row-major [rows, cols] matrices at `ld` and `stride` (0: one for all),
            random between them too."""
            size = (batch - 1) * stride + (rows - 1) * (ld or cols) + cols
            return cupy.asarray((rng.standard_normal(size) * scale).astype(dtype[t]))

        a = operand(*((k, m) if trans_a else (m, k)), lda, stride_a, t_ab, 1 / np.sqrt(k))
        b = operand(*((n, k) if trans_b else (k, n)), ldb, stride_b, t_ab, 1 / np.sqrt(k))
        c0 = operand(m, n, ldc, stride_c or m * n, t_c, 1.0)
        kw = dict(trans_a=trans_a, trans_b=trans_b, batch=batch, stride_a=stride_a, stride_b=stride_b,
                  stride_c=stride_c, lda=lda or None, ldb=ldb or None, ldc=ldc or None, alpha=1.0, beta=0.5)
        assert lt.tabled(c0, a, b, m, n, k, **kw), key  # the same alignment class as the step's buffers
        outs = []
        for run in (blas.gemm, blas.gemm_ex):
            c = c0.copy()
            run(c, a, b, m, n, k, **kw)
            outs.append(cupy.asnumpy(c).astype(np.float64))
        routed, ex = outs
        assert np.isfinite(routed).all(), key
        rel = np.linalg.norm(routed - ex) / np.linalg.norm(ex)
        assert rel < (1e-2 if t_c == "bfloat16" else 1e-5), (key, rel)
        assert not np.array_equal(routed, cupy.asnumpy(c0).astype(np.float64)), key  # it wrote its output
