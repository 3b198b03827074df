"""cuBLAS and cuBLASLt through ctypes, on handles of the engine's own (for the CUDA engine's products).

CuPy's cuBLAS wrappers call cublasSetStream before every product, and that call resets the handle's
workspace to cuBLAS's internal pool; these handles keep the engine's preallocated workspace, so a
product allocates nothing and can be recorded in a CUDA graph.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import cupy

# Algorithms measured faster than the heuristic's first for the products of ANDREA's steps, per GPU and cuBLASLt
# version (scripts/tune_gemm.py writes it): data, not a timing at run time, so every run takes the same ones.
ALGORITHMS_FILE = Path(__file__).with_name("cublaslt_algorithms.json")


def algorithm_table(tables: list[dict], device: str, version: int) -> dict[str, int]:
    """The choices (plan key's repr -> the heuristic's index) of the table made on this GPU and cuBLASLt version;
    none for another."""
    for table in tables:
        if table["device"] == device and table["cublaslt"] == version:
            return dict(table["choices"])
    return {}


def merged_tables(tables: list[dict], device: str, version: int, margin: float, choices: dict[str, int],
                  measured: dict[str, list[float]], baselines: dict[str, float] | None = None) -> list[dict]:
    """The tables with new measurements of this GPU and version (scripts/tune_gemm.py): the products measured
    now take their new entries (a choice, or none), the others keep theirs; a table made at another margin is
    started again, so that all its choices follow one. `baselines`: for the plain products (those the engine
    runs through cublasGemmEx unless the table names them), cublasGemmEx's ms, which a choice must beat; a
    cuBLASLt product's baseline is its heuristic's first, measured_ms[0]."""
    mine = next((t for t in tables if (t["device"], t["cublaslt"]) == (device, version)), None)
    if mine is not None and mine["margin"] != margin:
        mine = None
    kept = mine or {"choices": {}, "measured_ms": {}}
    kept_baselines = {k: v for k, v in kept.get("baseline_ms", {}).items() if k not in measured}
    table = {"device": device, "cublaslt": version, "margin": margin,
             "choices": {k: v for k, v in kept["choices"].items() if k not in measured} | choices,
             "measured_ms": kept["measured_ms"] | measured,
             "baseline_ms": kept_baselines | (baselines or {})}
    others = [t for t in tables if (t["device"], t["cublaslt"]) != (device, version)]
    return others + [table]


def baseline_ms(table: dict, name: str) -> float:
    """What a table's choice for a product had to beat: cublasGemmEx for a plain product, else the heuristic's first."""
    return table.get("baseline_ms", {}).get(name, table["measured_ms"][name][0])


def product_name(key: tuple) -> str:
    """A plan key without its algorithm index: the product, as the algorithm table names it."""
    return repr((*key[:10], *key[11:]))


def chosen_key(key: tuple, algo: int | None, choices: dict[str, int]) -> tuple:
    """The plan key with its algorithm index: `algo`, or (None) the table's choice for the product, else the
    heuristic's first (0). "gelu" takes gelu_aux's choice: it runs on gelu_aux's algorithm (CublasLt._plan)."""
    if algo is None:
        like = key if key[8] != "gelu" else (*key[:8], "gelu_aux", *key[9:])
        algo = choices.get(product_name(like), 0)
    return (*key[:10], algo, *key[11:])


class _HostScalars:
    """float32 host values that alpha and beta point at: one object per value, kept alive for the calls."""

    def __init__(self):
        self._values: dict[float, ctypes.c_float] = {}

    def __call__(self, value: float) -> int:
        s = self._values.get(value)
        if s is None:
            s = self._values[value] = ctypes.c_float(value)
        return ctypes.addressof(s)


class Cublas:
    """The two cuBLAS products the engine needs, through ctypes on an own handle.

    CuPy's cuBLAS wrappers call cublasSetStream before every product, and that call resets the
    handle's workspace to cuBLAS's internal pool; this handle keeps the engine's preallocated one.
    With `lt` (the 16-bit and fp8 builds), a product the algorithm table names runs through cuBLASLt
    on the table's algorithm instead: cublasGemmEx's own choice is slower for some of the step's
    shapes (scripts/tune_gemm.py measures both)."""

    OP_N, OP_T = 0, 1
    TYPES = {"float32": 0, "bfloat16": 14, "float16": 2}  # CUDA_R_32F, CUDA_R_16BF, CUDA_R_16F
    # FP32 operands: CUBLAS_COMPUTE_32F or, with TF32 products, CUBLAS_COMPUTE_32F_FAST_TF32; 16-bit operands:
    # CUBLAS_COMPUTE_32F.
    COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
    GEMM_DEFAULT = -1

    def __init__(self, tf32_products: bool, workspace, lt: CublasLt | None = None):
        from cuda import pathfinder

        lib = ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("cublas").abs_path)
        p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(p)]
        lib.cublasSetStream_v2.argtypes = [p, p]
        lib.cublasSetWorkspace_v2.argtypes = [p, p, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        lib.cublasGemmStridedBatchedEx.argtypes = [p, i, i, i, i, i, p, p, i, i, ll, p, i, i, ll, p, p, i, i, ll, i, i, i]
        self.lib = lib
        self.compute = self.COMPUTE_32F_FAST_TF32 if tf32_products else self.COMPUTE_32F
        self.workspace = workspace
        handle = p()
        self._check("cublasCreate_v2", lib.cublasCreate_v2(ctypes.byref(handle)))
        self.handle = handle.value
        self.stream = None
        self._scalar = _HostScalars()
        self.lt = lt
        self._bind_stream()

    @staticmethod
    def _check(name: str, status: int) -> None:
        if status:
            raise RuntimeError(f"{name} failed with cuBLAS status {status}")

    def _bind_stream(self) -> None:
        """Follow CuPy's current stream; setting a stream drops the workspace, so set it again."""
        stream = cupy.cuda.get_current_stream().ptr
        if stream != self.stream:
            self._check("cublasSetStream_v2", self.lib.cublasSetStream_v2(self.handle, stream))
            self._check("cublasSetWorkspace_v2", self.lib.cublasSetWorkspace_v2(
                self.handle, self.workspace.data.ptr, self.workspace.nbytes))
            self.stream = stream

    def gemm(self, c, a, b, m, n, k, *, trans_a=False, trans_b=False, lda=None, ldb=None, ldc=None,
             alpha=1.0, beta=0.0, batch=1, stride_a=0, stride_b=0, stride_c=0):
        """Row-major C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] + beta * C on CuPy arrays (their first
        element; A and B of one dtype, C of its own: bf16 products may write FP32), FP32 accumulation.

        cuBLAS is column-major, where a row-major matrix reads as its transpose: so it computes
        C^T = op(B)^T op(A)^T, with the operands swapped and each transpose flag kept."""
        if self.lt is not None:
            kw = dict(trans_a=trans_a, trans_b=trans_b, batch=batch, stride_a=stride_a, stride_b=stride_b,
                      stride_c=stride_c, lda=lda, ldb=ldb, ldc=ldc)
            if self.lt.tabled(c, a, b, m, n, k, **kw) and self.lt.gemm(c, a, b, m, n, k, alpha=alpha, beta=beta, **kw):
                return
        self.gemm_ex(c, a, b, m, n, k, trans_a=trans_a, trans_b=trans_b, lda=lda, ldb=ldb, ldc=ldc, alpha=alpha,
                     beta=beta, batch=batch, stride_a=stride_a, stride_b=stride_b, stride_c=stride_c)

    def gemm_ex(self, c, a, b, m, n, k, *, trans_a=False, trans_b=False, lda=None, ldb=None, ldc=None,
                alpha=1.0, beta=0.0, batch=1, stride_a=0, stride_b=0, stride_c=0):
        """`gemm` through cublasGemmEx (cuBLAS's own algorithm), whatever the table says."""
        t_ab, t_c = self.TYPES[a.dtype.name], self.TYPES[c.dtype.name]
        compute = self.compute if t_ab == self.TYPES["float32"] else self.COMPUTE_32F
        c, a, b = c.data.ptr, a.data.ptr, b.data.ptr
        lda = lda or (m if trans_a else k)
        ldb = ldb or (k if trans_b else n)
        ldc = ldc or n
        op_a = self.OP_T if trans_a else self.OP_N
        op_b = self.OP_T if trans_b else self.OP_N
        self._bind_stream()
        if batch == 1:
            status = self.lib.cublasGemmEx(
                self.handle, op_b, op_a, n, m, k, self._scalar(alpha), b, t_ab, ldb, a, t_ab, lda,
                self._scalar(beta), c, t_c, ldc, compute, self.GEMM_DEFAULT)
            self._check("cublasGemmEx", status)
        else:
            status = self.lib.cublasGemmStridedBatchedEx(
                self.handle, op_b, op_a, n, m, k, self._scalar(alpha), b, t_ab, ldb, stride_b, a, t_ab, lda, stride_a,
                self._scalar(beta), c, t_c, ldc, stride_c, batch, compute, self.GEMM_DEFAULT)
            self._check("cublasGemmStridedBatchedEx", status)


class CublasLt:
    """cuBLASLt products: with a GELU epilogue for the 16-bit builds, and on FP8 operands.

    The MLP's up-projection writes act = GELU(pre) with pre beside it (GELU_AUX), and the backward's
    dout @ W_2^T comes out already times GELU'(pre) (DGELU, reading pre): no elementwise GELU pass over
    [B, T, 4C] beside the products. FP8 operands (E4M3, E5M2; held in uint8 buffers, their type named by
    the caller) come with a device scale each, the factor that takes the stored values back to theirs:
    D = scale_a * scale_b * (A @ B), accumulated in FP32; Hopper's FP8 products take both operands
    K-major only (row-major A [m, k] and B stored [n, k], trans_b).

    Row-major as Cublas.gemm (operands swapped for column-major cuBLAS). The descriptors and the
    heuristic's algorithm are made once per shape, so a shape always runs the same algorithm (the same
    bits); `gemm` returns False where cuBLASLt offers no algorithm, and the caller runs the plain product
    and the GELU kernel instead."""

    # CUBLASLT_EPILOGUE_{DEFAULT,GELU,GELU_AUX,DGELU}; "gelu" runs with gelu_aux's algorithm (_plan)
    EPILOGUES = {"none": 1, "gelu": 32, "gelu_aux": 32 | 128, "dgelu": 64 | 128}
    AUX_EPILOGUES = ("gelu_aux", "dgelu")  # the epilogues that write or read `aux`
    TYPES = {**Cublas.TYPES, "e4m3": 28, "e5m2": 29}  # CUDA_R_8F_E4M3, CUDA_R_8F_E5M2
    DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_AUX_POINTER, DESC_AUX_LD = 3, 4, 7, 11, 12
    DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM = 17, 18, 25
    DESC_D_SCALE_POINTER, DESC_AMAX_D_POINTER, DESC_AUX_DATA_TYPE = 20, 21, 22
    FP8_OUTPUTS = ("e4m3", "e5m2")  # a D of these types comes with C in bf16 (beta 0: C is not read)
    LAYOUT_BATCH_COUNT, LAYOUT_STRIDED_BATCH_OFFSET = 5, 6
    PREF_MAX_WORKSPACE_BYTES = 1
    PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES (uint32, default 256)
    SCALE_32F = 0  # CUDA_R_32F
    HEURISTICS = 8  # algorithms asked of the heuristic when a caller picks other than its first

    class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
        _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                    ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]

    def __init__(self, workspace):
        from cuda import pathfinder

        lib = ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("cublasLt").abs_path)
        p, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(p)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(p), i, i]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [p, i, p, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(p), i, u64, u64, i64]
        lib.cublasLtMatrixLayoutSetAttribute.argtypes = [p, i, p, sz]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(p)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [p, i, p, sz]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [p, p, p, p, p, p, p, i, ctypes.POINTER(self._Heuristic),
                                                       ctypes.POINTER(i)]
        lib.cublasLtMatmul.argtypes = [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(self._Heuristic), p, sz, p]
        lib.cublasLtMatmulAlgoCheck.argtypes = [p, p, p, p, p, p, p, ctypes.POINTER(self._Heuristic)]
        self.lib = lib
        self.workspace = workspace
        handle = p()
        Cublas._check("cublasLtCreate", lib.cublasLtCreate(ctypes.byref(handle)))
        self.handle = handle.value
        self._plans: dict = {}
        self._tabled: dict = {}  # plan key -> whether the table names the product (tabled)
        self._scalar = _HostScalars()
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        self.version = int(lib.cublasLtGetVersion())
        self.device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        tables = json.loads(ALGORITHMS_FILE.read_text())["tables"] if ALGORITHMS_FILE.is_file() else []
        self.choices = algorithm_table(tables, self.device, self.version)

    def _set(self, desc, attr: int, value) -> None:
        Cublas._check("cublasLtMatmulDescSetAttribute", self.lib.cublasLtMatmulDescSetAttribute(
            desc, attr, ctypes.byref(value), ctypes.sizeof(value)))

    def _layout(self, dtype: str, rows: int, cols: int, ld: int, batch: int = 1, stride: int = 0):
        layout = ctypes.c_void_p()
        Cublas._check("cublasLtMatrixLayoutCreate", self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), self.TYPES[dtype], rows, cols, ld))
        if batch > 1:
            for attr, value in ((self.LAYOUT_BATCH_COUNT, ctypes.c_int32(batch)),
                                (self.LAYOUT_STRIDED_BATCH_OFFSET, ctypes.c_int64(stride))):
                Cublas._check("cublasLtMatrixLayoutSetAttribute", self.lib.cublasLtMatrixLayoutSetAttribute(
                    layout, attr, ctypes.byref(value), ctypes.sizeof(value)))
        return layout

    def _plan(self, key, aux, scales=None):
        (t_c, t_a, t_b, m, n, k, trans_a, trans_b, epilogue, accumulation, algo_index,
         (batch, stride_a, stride_b, stride_c, *lds), align_b, align_a, align_c, _) = key
        lda, ldb, ldc = lds or (0, 0, 0)  # 0: the packed matrix's
        lib = self.lib
        desc = ctypes.c_void_p()
        Cublas._check("cublasLtMatmulDescCreate", lib.cublasLtMatmulDescCreate(
            ctypes.byref(desc), Cublas.COMPUTE_32F, self.SCALE_32F))
        self._set(desc, self.DESC_TRANSA, ctypes.c_int(Cublas.OP_T if trans_b else Cublas.OP_N))
        self._set(desc, self.DESC_TRANSB, ctypes.c_int(Cublas.OP_T if trans_a else Cublas.OP_N))
        self._set(desc, self.DESC_EPILOGUE, ctypes.c_int(self.EPILOGUES[epilogue]))
        if aux is not None and epilogue in self.AUX_EPILOGUES:
            self._set(desc, self.DESC_AUX_POINTER, ctypes.c_void_p(aux.data.ptr))
            self._set(desc, self.DESC_AUX_LD, ctypes.c_int64(n))
        if scales is not None:
            self._set_scales(desc, *scales)
        if accumulation == "fast":
            self._set(desc, self.DESC_FAST_ACCUM, ctypes.c_int8(1))
        fp8_out = t_c in self.FP8_OUTPUTS
        if fp8_out and epilogue in self.AUX_EPILOGUES:  # aux stays bf16 (its default would be D's type)
            self._set(desc, self.DESC_AUX_DATA_TYPE, ctypes.c_int(self.TYPES["bfloat16"]))
        # column-major: cuBLAS's A is our B (n x k as stored, or k x n transposed), its B our A, C is n x m
        lay_b = (self._layout(t_b, k, n, ldb or k, batch, stride_b) if trans_b
                 else self._layout(t_b, n, k, ldb or n, batch, stride_b))
        lay_a = (self._layout(t_a, m, k, lda or m, batch, stride_a) if trans_a
                 else self._layout(t_a, k, m, lda or k, batch, stride_a))
        lay_d = self._layout(t_c, n, m, ldc or n, batch, stride_c)
        lay_c = self._layout("bfloat16", n, m, ldc or n, batch, stride_c) if fp8_out else lay_d
        pref = ctypes.c_void_p()
        Cublas._check("cublasLtMatmulPreferenceCreate", lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)))
        limit = ctypes.c_uint64(self.workspace.nbytes)
        Cublas._check("cublasLtMatmulPreferenceSetAttribute", lib.cublasLtMatmulPreferenceSetAttribute(
            pref, self.PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), ctypes.sizeof(limit)))
        # only algorithms that take the operands' actual alignment (cuBLAS's A, B, C, D: our b, a, c, c)
        for attr, align in zip(self.PREF_MIN_ALIGNMENT, (align_b, align_a, align_c, align_c)):
            value = ctypes.c_uint32(align)
            Cublas._check("cublasLtMatmulPreferenceSetAttribute", lib.cublasLtMatmulPreferenceSetAttribute(
                pref, attr, ctypes.byref(value), ctypes.sizeof(value)))
        if epilogue == "gelu":
            # GELU(A @ B) alone (a recompute whose pre is saved), by the algorithm gelu_aux runs on the same operands
            # and aux, so act gets the same bits as that product wrote; none where that algorithm cannot do it
            like = (*key[:8], "gelu_aux", *key[9:])
            base = self._plans[like] if like in self._plans else self._plan(like, aux, scales)
            checked = self._Heuristic()
            ok = base is not None and lib.cublasLtMatmulAlgoCheck(
                self.handle, desc, lay_b, lay_a, lay_c, lay_d, ctypes.addressof(base[4]), ctypes.byref(checked)) == 0
            plan = (desc, lay_b, lay_a, lay_c, base[4], lay_d) if ok else None
            self._plans[key] = plan
            return plan
        wanted = max(1, algo_index + 1)
        results, found = (self._Heuristic * wanted)(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, lay_b, lay_a, lay_c, lay_d, pref, wanted,
                                                    results, ctypes.byref(found))
        ok = status == 0 and found.value > algo_index
        plan = (desc, lay_b, lay_a, lay_c, results[algo_index], lay_d) if ok else None
        self._plans[key] = plan
        return plan

    def _set_scales(self, desc, a_scale, b_scale) -> None:
        """The FP8 operands' device descales; cuBLAS's A is our B."""
        self._set(desc, self.DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale.data.ptr))
        self._set(desc, self.DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale.data.ptr))

    def algorithms(self, c, a, b, m, n, k, **kw) -> int:
        """How many algorithms the heuristic offers for this product (up to HEURISTICS): `algo` below
        takes 0 .. that - 1."""
        return sum(self.plan_for(c, a, b, m, n, k, algo=i, **kw)[1] is not None for i in range(self.HEURISTICS))

    @staticmethod
    def plan_key(c, a, b, m, n, k, *, trans_a=False, trans_b=False, epilogue="none", aux=None, a_type=None,
                 b_type=None, a_scale=None, fast_accum=False, algo=None, batch=1, stride_a=0, stride_b=0, stride_c=0,
                 d_type=None, lda=None, ldb=None, ldc=None, **_) -> tuple:
        """The key of a product's plan (and its name in the algorithm table, product_name)."""
        # a plan per shape and alignment class: the heuristic picks for the pointers' alignment (aux's included)
        aligns = map(_alignment, (b, a, c, c if aux is None else aux))
        accumulation = None if a_scale is None else ("fast" if fast_accum else "split")  # FP8 products only
        # leading dimensions of their own (0 where packed) only where some are given: a packed product's key, so
        # its name in the table, does not change with them
        lds = (lda or 0, ldb or 0, ldc or 0) if lda or ldb or ldc else ()
        return (d_type or c.dtype.name, a_type or a.dtype.name, b_type or b.dtype.name, m, n, k, trans_a, trans_b, epilogue,
                accumulation, algo, (batch, stride_a, stride_b, stride_c, *lds), *aligns)

    def tabled(self, c, a, b, m, n, k, **kw) -> bool:
        """Whether the algorithm table names this product (Cublas.gemm then runs it here): looked up once a
        shape, as the plans are, since every plain product of an eager pass asks."""
        key = self.plan_key(c, a, b, m, n, k, **kw)
        if key not in self._tabled:
            self._tabled[key] = product_name(key) in self.choices
        return self._tabled[key]

    def plan_for(self, c, a, b, m, n, k, *, trans_a=False, trans_b=False, epilogue="none", aux=None,
                 a_type=None, b_type=None, a_scale=None, b_scale=None, fast_accum=False, algo=None, batch=1, stride_a=0,
                 stride_b=0, stride_c=0, d_type=None, lda=None, ldb=None, ldc=None):
        """(the product's plan key, its plan: None where the heuristic has no algorithm `algo` for it)."""
        key = self.plan_key(c, a, b, m, n, k, trans_a=trans_a, trans_b=trans_b, epilogue=epilogue, aux=aux,
                            a_type=a_type, b_type=b_type, a_scale=a_scale, fast_accum=fast_accum, algo=algo, batch=batch,
                            stride_a=stride_a, stride_b=stride_b, stride_c=stride_c, d_type=d_type, lda=lda, ldb=ldb,
                            ldc=ldc)
        if key not in self._plans:  # algo None: the table's choice, looked up once a shape
            chosen = chosen_key(key, algo, self.choices)
            if chosen not in self._plans:
                self._plan(chosen, aux, None if a_scale is None else (a_scale, b_scale))
            self._plans[key] = self._plans[chosen]
        return key, self._plans[key]

    def gemm(self, c, a, b, m, n, k, *, trans_a=False, trans_b=False, epilogue: str = "none", aux=None,
             a_type=None, b_type=None, a_scale=None, b_scale=None, fast_accum: bool = False, alpha: float = 1.0,
             beta: float = 0.0, algo: int | None = None, batch: int = 1, stride_a: int = 0, stride_b: int = 0,
             stride_c: int = 0, d_type: str | None = None, d_scale=None, amax_d=None, lda: int | None = None,
             ldb: int | None = None, ldc: int | None = None) -> bool:
        """Row-major C[m, n] = epilogue(alpha * op(A)[m, k] @ op(B)[k, n]) + beta * C, with `aux` [m, n] for the GELU
        epilogues (GELU's input: written by gelu_aux, read by dgelu; "gelu" leaves it as it is, and gives C the
        bits gelu_aux gives it with that aux). FP8 operands: a_type/b_type ("e4m3", "e5m2") and a_scale/b_scale
        (FP32 device scalars); `fast_accum`, the tensor cores' own accumulator through the whole of K instead of
        sums promoted to FP32 as they go (faster, less exact: andrea/ops/fp8.py). `algo` takes the heuristic's
        algo-th choice (0: its first); None, the algorithm table's choice for the product where it has one
        (ALGORITHMS_FILE), else its first. `batch` products with the operands' strides in elements (0: the same
        matrix for each) and lda, ldb, ldc (None: packed), as Cublas.gemm. `d_type` ("e4m3", "e5m2"): C (the
        uint8 `c`) written in FP8, times the device scale `d_scale`, with the largest |value| before that scale
        into the device float `amax_d`; the product's C operand is then bf16 and not read (beta 0): aux's place
        where there is one. False (nothing run) where cuBLASLt has no algorithm for it."""
        if d_type is not None and beta != 0.0:
            raise ValueError("CublasLt.gemm: an FP8 output (d_type) takes beta 0")
        key, plan = self.plan_for(c, a, b, m, n, k, trans_a=trans_a, trans_b=trans_b, epilogue=epilogue, aux=aux,
                                  a_type=a_type, b_type=b_type, a_scale=a_scale, b_scale=b_scale, fast_accum=fast_accum,
                                  algo=algo, batch=batch, stride_a=stride_a, stride_b=stride_b, stride_c=stride_c,
                                  d_type=d_type, lda=lda, ldb=ldb, ldc=ldc)
        if plan is None:
            return False
        desc, lay_b, lay_a, lay_c, result, lay_d = plan
        if aux is not None and epilogue in self.AUX_EPILOGUES:
            self._set(desc, self.DESC_AUX_POINTER, ctypes.c_void_p(aux.data.ptr))
        if a_scale is not None:
            self._set_scales(desc, a_scale, b_scale)
        c_in = c
        if d_type is not None:
            self._set(desc, self.DESC_D_SCALE_POINTER, ctypes.c_void_p(d_scale.data.ptr))
            self._set(desc, self.DESC_AMAX_D_POINTER, ctypes.c_void_p(amax_d.data.ptr))
            c_in = aux if aux is not None else c
        Cublas._check("cublasLtMatmul", self.lib.cublasLtMatmul(
            self.handle, desc, self._scalar(alpha), b.data.ptr, lay_b, a.data.ptr, lay_a, self._scalar(beta),
            c_in.data.ptr, lay_c, c.data.ptr, lay_d, ctypes.byref(result), self.workspace.data.ptr,
            self.workspace.nbytes, cupy.cuda.get_current_stream().ptr))
        return True


def _alignment(a) -> int:
    """The largest power of two up to 256 dividing an array's device address (cuBLASLt's alignment classes)."""
    p = a.data.ptr
    return min(256, p & -p) if p else 256
