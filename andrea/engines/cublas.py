"""cuBLAS and cuBLASLt through ctypes, on handles of the engine's own (for the CUDA engine's products).

CuPy's cuBLAS wrappers call cublasSetStream before every product, and that call resets the handle's
workspace to cuBLAS's internal pool; these handles keep the engine's preallocated workspace, so a
product allocates nothing and can be recorded in a CUDA graph.
"""

from __future__ import annotations

import ctypes

import cupy

class Cublas:
    """The two cuBLAS products the engine needs, through ctypes on an own handle.

    CuPy's cuBLAS wrappers call cublasSetStream before every product, and that call resets the
    handle's workspace to cuBLAS's internal pool; this handle keeps the engine's preallocated one."""

    OP_N, OP_T = 0, 1
    TYPES = {"float32": 0, "bfloat16": 14, "float16": 2}  # CUDA_R_32F, CUDA_R_16BF, CUDA_R_16F
    # FP32 operands: CUBLAS_COMPUTE_32F or, with TF32 products, CUBLAS_COMPUTE_32F_FAST_TF32; 16-bit operands:
    # CUBLAS_COMPUTE_32F.
    COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
    GEMM_DEFAULT = -1

    def __init__(self, tf32_products: bool, workspace):
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
        self._scalars = {}  # host scalars that alpha/beta point at, one per value
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

    def _scalar(self, value: float) -> int:
        s = self._scalars.get(value)
        if s is None:
            s = self._scalars[value] = ctypes.c_float(value)
        return ctypes.addressof(s)

    def gemm(self, c, a, b, m, n, k, *, trans_a=False, trans_b=False, lda=None, ldb=None, ldc=None,
             alpha=1.0, beta=0.0, batch=1, stride_a=0, stride_b=0, stride_c=0):
        """Row-major C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] + beta * C on CuPy arrays (their first
        element; A and B of one dtype, C of its own: bf16 products may write FP32), FP32 accumulation.

        cuBLAS is column-major, where a row-major matrix reads as its transpose: so it computes
        C^T = op(B)^T op(A)^T, with the operands swapped and each transpose flag kept."""
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
    """cuBLASLt products with a GELU epilogue, for the 16-bit builds: the MLP's up-projection writes
    act = GELU(pre) with pre beside it (GELU_AUX), and the backward's dout @ W_2^T comes out already times
    GELU'(pre) (DGELU, reading pre): no elementwise GELU pass over [B, T, 4C] beside the products.

    Row-major as Cublas.gemm (operands swapped for column-major cuBLAS). The descriptors and the
    heuristic's algorithm are made once per shape, so a shape always runs the same algorithm (the same
    bits); `gemm` returns False where cuBLASLt offers no algorithm, and the caller runs the plain product
    and the GELU kernel instead."""

    EPILOGUES = {"gelu_aux": 32 | 128, "dgelu": 64 | 128}  # CUBLASLT_EPILOGUE_GELU_AUX, CUBLASLT_EPILOGUE_DGELU
    DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_AUX_POINTER, DESC_AUX_LD = 3, 4, 7, 11, 12
    PREF_MAX_WORKSPACE_BYTES = 1
    PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES (uint32, default 256)
    SCALE_32F = 0  # CUDA_R_32F

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
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(p)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [p, i, p, sz]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [p, p, p, p, p, p, p, i, ctypes.POINTER(self._Heuristic),
                                                       ctypes.POINTER(i)]
        lib.cublasLtMatmul.argtypes = [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(self._Heuristic), p, sz, p]
        self.lib = lib
        self.workspace = workspace
        handle = p()
        Cublas._check("cublasLtCreate", lib.cublasLtCreate(ctypes.byref(handle)))
        self.handle = handle.value
        self._plans: dict = {}
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _set(self, desc, attr: int, value) -> None:
        Cublas._check("cublasLtMatmulDescSetAttribute", self.lib.cublasLtMatmulDescSetAttribute(
            desc, attr, ctypes.byref(value), ctypes.sizeof(value)))

    def _layout(self, dtype: str, rows: int, cols: int, ld: int):
        layout = ctypes.c_void_p()
        Cublas._check("cublasLtMatrixLayoutCreate", self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), Cublas.TYPES[dtype], rows, cols, ld))
        return layout

    def _plan(self, key, aux):
        t_c, t_ab, m, n, k, trans_a, trans_b, epilogue, align_b, align_a, align_c, _ = key
        lib = self.lib
        desc = ctypes.c_void_p()
        Cublas._check("cublasLtMatmulDescCreate", lib.cublasLtMatmulDescCreate(
            ctypes.byref(desc), Cublas.COMPUTE_32F, self.SCALE_32F))
        self._set(desc, self.DESC_TRANSA, ctypes.c_int(Cublas.OP_T if trans_b else Cublas.OP_N))
        self._set(desc, self.DESC_TRANSB, ctypes.c_int(Cublas.OP_T if trans_a else Cublas.OP_N))
        self._set(desc, self.DESC_EPILOGUE, ctypes.c_int(self.EPILOGUES[epilogue]))
        self._set(desc, self.DESC_AUX_POINTER, ctypes.c_void_p(aux.data.ptr))
        self._set(desc, self.DESC_AUX_LD, ctypes.c_int64(n))
        # column-major: cuBLAS's A is our B (n x k as stored, or k x n transposed), its B our A, C is n x m
        lay_b = self._layout(t_ab, k, n, k) if trans_b else self._layout(t_ab, n, k, n)
        lay_a = self._layout(t_ab, m, k, m) if trans_a else self._layout(t_ab, k, m, k)
        lay_c = self._layout(t_c, n, m, n)
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
        result, found = self._Heuristic(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, lay_b, lay_a, lay_c, lay_c, pref, 1,
                                                    ctypes.byref(result), ctypes.byref(found))
        plan = (desc, lay_b, lay_a, lay_c, result) if status == 0 and found.value > 0 else None
        self._plans[key] = plan
        return plan

    def gemm(self, c, a, b, m, n, k, *, trans_a=False, trans_b=False, epilogue: str, aux) -> bool:
        """Row-major C[m, n] = epilogue(op(A)[m, k] @ op(B)[k, n]) with `aux` [m, n] (GELU's input: written by
        gelu_aux, read by dgelu); False (nothing run) where cuBLASLt has no algorithm for it."""
        # a plan per shape and alignment class: the heuristic picks for the pointers' alignment (aux's included)
        key = (c.dtype.name, a.dtype.name, m, n, k, trans_a, trans_b, epilogue, *map(_alignment, (b, a, c, aux)))
        plan = self._plans[key] if key in self._plans else self._plan(key, aux)
        if plan is None:
            return False
        desc, lay_b, lay_a, lay_c, algo = plan
        self._set(desc, self.DESC_AUX_POINTER, ctypes.c_void_p(aux.data.ptr))
        Cublas._check("cublasLtMatmul", self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self._one), b.data.ptr, lay_b, a.data.ptr, lay_a, ctypes.byref(self._zero),
            c.data.ptr, lay_c, c.data.ptr, lay_c, ctypes.byref(algo), self.workspace.data.ptr, self.workspace.nbytes,
            cupy.cuda.get_current_stream().ptr))
        return True


def _alignment(a) -> int:
    """The largest power of two up to 256 dividing an array's device address (cuBLASLt's alignment classes)."""
    p = a.data.ptr
    return min(256, p & -p) if p else 256
