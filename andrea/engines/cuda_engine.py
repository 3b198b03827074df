"""CUDA engine: the NumPy engine's API on CuPy, with the kernels of kernels/*.cu and cuBLAS.

Arrays are CuPy views into buffers allocated once from the memory plan (contiguous, row-major, the
shapes of numpy_engine.py). Backward ops ADD into their grad buffers (weight-gradient products run
with beta = 1), the input's gradient too unless `overwrite` (then it is written: beta = 0, no memset
first); scratch arguments (d_att, d_mlp_pre, d_logits, and the branch gradient of
layernorm_residual_bwd) are overwritten.

Attention is fused (kernels/attn.cu): it saves the per-row logsumexp [B, H, T] in `att` instead of the
probabilities (`attention = "lse"` tells the memory plan), and `d_att` [B, H, T] holds rowsum(dY * Y) (= rowsum(P * dP)).

Nothing is allocated on the device after construction and `allocate`: kernels write into the
caller's buffers, cuBLAS runs on the engine's own handle with a preallocated workspace, and host
reads copy into host memory. Every reduction runs in a fixed order: the same inputs give the same
bits on every run.

Precision: "fp32" (the reference), "tf32" (the matrix products on tensor cores with TF32 inputs and
FP32 accumulation), "bf16" (mixed precision: activations, the activation gradients that feed products
and a copy of the weights in bfloat16, FP32 accumulation in every product and FP32 arithmetic in every
kernel; LayerNorm, softmax and loss statistics, the residual-stream gradients, weights, gradients, m
and v stay FP32) or "fp16" (the same in IEEE half, the seed's cuBLAS FP16 route; its narrow range needs
the model's dynamic loss scale). At head width 64 the 16-bit precisions' attention is kernels/attn_bf16.cu (the
bf16 or f16 mma); other widths run attn.cu on TF32 products. Weights, m and v are FP32 in every precision: the
checkpoint is the same. The fp32
attention kernels use the tensor cores too, in "3xTF32" (each operand split into two TF32 parts, three
products: FP32-level accuracy, the same arithmetic as PyTorch's fp32 memory-efficient attention).
Each precision is its own build of kernels/*.cu (the activation type act_t, kernels/common.cuh).
"""

from __future__ import annotations

import ctypes
import math

import cupy
import ml_dtypes  # noqa: F401  (registers NumPy's "bfloat16" dtype, which the bf16 buffers use)
import numpy as np

from andrea.errors import AndreaError
from andrea.kernels_build import build_options, kernel_dir, kernel_source
from andrea.memory import BufferSpec

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
ACT_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}
KERNELS = {  # kernels/<file>.cu -> its kernels (attn_qkv and attn_out are cuBLAS products only)
    "embed": ("k_embed_fwd", "k_embed_bwd"),
    "layernorm": ("k_layernorm_fwd", "k_layernorm_bwd", "k_layernorm_bwd_sum",
                  *(f"k_layernorm_bwd_cached{j}" for j in range(1, 5))),
    "attn": ("k_attn_fwd", "k_attn_bwd_dq", "k_attn_bwd"),
    "attn_bf16": ("k_attn_fwd_bf16", "k_attn_bwd_dq_bf16", "k_attn_bwd_bf16"),
    "mlp": ("k_mlp_fwd", "k_mlp_bwd"),
    "residual_add": ("k_residual_add", "k_residual_add_bwd"),
    "loss": ("k_loss_fwd", "k_loss_bwd", "k_loss_bwd_in_place"),
    "grad_norm": ("k_grad_norm_partial", "k_grad_norm_final", "k_grad_scale"),
    "adamw": ("k_adamw", "k_cast_params"),
}
# Launch shapes the kernels are written for (the #defines of the same names in kernels/*.cu).
EMBED_BWD_THREADS, EMBED_BWD_COLS = 256, 16
EMBED_FWD_THREADS = 128  # a block per position: 128 x 16 bytes covers a bf16 row of C <= 1024 in one sweep
LN_THREADS, LN_CHUNKS, LN_SUM_THREADS = 1024, 128, 1024
LN_MAX_C = 4096  # widest row the LayerNorm backward's partial sums (ln_partials) hold
# The cached LayerNorm backward (k_layernorm_bwd_cached<J>): blocks of LN_BWD_WARPS warps, each block one chunk
# of LN_BWD_ROWS rows (more where ln_partials could not hold that many chunks), J 16-byte groups a lane.
LN_BWD_WARPS, LN_BWD_ROWS, LN_BWD_MAX_GROUPS = 8, 32, 4
LOSS_THREADS = 1024
ATTN_THREADS, ATTN_TILE, ATTN_LD = 128, 64, 68
ATTN_FWD_SMEM = 3 * ATTN_TILE * ATTN_LD * 4  # Q, K, V tiles
ATTN_BWD_SMEM = 4 * ATTN_TILE * ATTN_LD * 4 + 2 * ATTN_TILE * 4  # Q, dY, K, V tiles; a query tile's lse and D
# kernels/attn_bf16.cu: 16-bit activations (the bf16 mma, or the f16 one in the fp16 build), head width 64 only,
# static shared memory only; its launch shape is the module's constant attn_bf16_launch (threads and query rows
# of a forward / dQ block, threads and key rows of a dK/dV block), read when the module loads.
ATTN_BF16_HEAD = 64
MMA16_ATTENTION = ("bf16", "fp16")  # the precisions whose attention runs kernels/attn_bf16.cu
ELEMENTWISE_THREADS = 256
NORM_THREADS = 512

ALIGN = 256  # bytes: every plan buffer starts on this boundary inside the one device allocation
CUBLAS_WORKSPACE_BYTES = 32 * 2**20  # cuBLAS's recommended workspace on Hopper
MAX_DECAY_RANGES = 1024

_modules: dict[tuple[str, str, tuple[str, ...]], cupy.RawModule] = {}


def _load_kernels(precision: str) -> dict:
    """Every kernel of one precision's build, compiled once per process (and cached on disk by CuPy,
    keyed by source and options)."""
    folder = kernel_dir()
    options = build_options(precision)
    functions = {}
    for op, names in KERNELS.items():
        if op == "attn_bf16" and precision not in MMA16_ATTENTION:
            continue
        key = (str(folder), op, options)
        if key not in _modules:
            _modules[key] = cupy.RawModule(code=kernel_source(op, folder), options=options, backend="nvrtc")
        functions.update({name: _modules[key].get_function(name) for name in names})
        if op == "attn_bf16":
            launch = cupy.ndarray((4,), np.int32, memptr=_modules[key].get_global("attn_bf16_launch")).get()
            functions["attn_bf16_launch"] = tuple(int(x) for x in launch)
    # Over 48 KB of dynamic shared memory needs the limit raised per kernel; the largest shared-memory
    # carveout lets 3-4 attention blocks share an SM.
    for name, smem in (("k_attn_fwd", ATTN_FWD_SMEM), ("k_attn_bwd_dq", ATTN_BWD_SMEM), ("k_attn_bwd", ATTN_BWD_SMEM)):
        functions[name].max_dynamic_shared_size_bytes = smem
        functions[name].preferred_shared_memory_carveout = 100
    for name in KERNELS["attn_bf16"]:
        if name in functions:
            functions[name].preferred_shared_memory_carveout = 100
    return functions


class _Cublas:
    """The two cuBLAS products the engine needs, through ctypes on an own handle.

    CuPy's cuBLAS wrappers call cublasSetStream before every product, and that call resets the
    handle's workspace to cuBLAS's internal pool; this handle keeps the engine's preallocated one."""

    OP_N, OP_T = 0, 1
    TYPES = {"float32": 0, "bfloat16": 14, "float16": 2}  # CUDA_R_32F, CUDA_R_16BF, CUDA_R_16F
    COMPUTE_32F = 68
    # FP32 operands: CUBLAS_COMPUTE_32F or CUBLAS_COMPUTE_32F_FAST_TF32; 16-bit operands: CUBLAS_COMPUTE_32F.
    COMPUTE = {"fp32": 68, "tf32": 77, "bf16": 68, "fp16": 68}
    GEMM_DEFAULT = -1

    def __init__(self, precision: str, workspace):
        from cuda import pathfinder

        lib = ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("cublas").abs_path)
        p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(p)]
        lib.cublasSetStream_v2.argtypes = [p, p]
        lib.cublasSetWorkspace_v2.argtypes = [p, p, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        lib.cublasGemmStridedBatchedEx.argtypes = [p, i, i, i, i, i, p, p, i, i, ll, p, i, i, ll, p, p, i, i, ll, i, i, i]
        self.lib = lib
        self.compute = self.COMPUTE[precision]
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


class _CublasLt:
    """cuBLASLt products with a GELU epilogue, for the 16-bit builds: the MLP's up-projection writes
    act = GELU(pre) with pre beside it (GELU_AUX), and the backward's dout @ W_2^T comes out already times
    GELU'(pre) (DGELU, reading pre): no elementwise GELU pass over [B, T, 4C] beside the products.

    Row-major as _Cublas.gemm (operands swapped for column-major cuBLAS). The descriptors and the
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
        _Cublas._check("cublasLtCreate", lib.cublasLtCreate(ctypes.byref(handle)))
        self.handle = handle.value
        self._plans: dict = {}
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _set(self, desc, attr: int, value) -> None:
        _Cublas._check("cublasLtMatmulDescSetAttribute", self.lib.cublasLtMatmulDescSetAttribute(
            desc, attr, ctypes.byref(value), ctypes.sizeof(value)))

    def _layout(self, dtype: str, rows: int, cols: int, ld: int):
        layout = ctypes.c_void_p()
        _Cublas._check("cublasLtMatrixLayoutCreate", self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), _Cublas.TYPES[dtype], rows, cols, ld))
        return layout

    def _plan(self, key, aux):
        t_c, t_ab, m, n, k, trans_a, trans_b, epilogue, align_b, align_a, align_c, _ = key
        lib = self.lib
        desc = ctypes.c_void_p()
        _Cublas._check("cublasLtMatmulDescCreate", lib.cublasLtMatmulDescCreate(
            ctypes.byref(desc), _Cublas.COMPUTE_32F, self.SCALE_32F))
        self._set(desc, self.DESC_TRANSA, ctypes.c_int(_Cublas.OP_T if trans_b else _Cublas.OP_N))
        self._set(desc, self.DESC_TRANSB, ctypes.c_int(_Cublas.OP_T if trans_a else _Cublas.OP_N))
        self._set(desc, self.DESC_EPILOGUE, ctypes.c_int(self.EPILOGUES[epilogue]))
        self._set(desc, self.DESC_AUX_POINTER, ctypes.c_void_p(aux.data.ptr))
        self._set(desc, self.DESC_AUX_LD, ctypes.c_int64(n))
        # column-major: cuBLAS's A is our B (n x k as stored, or k x n transposed), its B our A, C is n x m
        lay_b = self._layout(t_ab, k, n, k) if trans_b else self._layout(t_ab, n, k, n)
        lay_a = self._layout(t_ab, m, k, m) if trans_a else self._layout(t_ab, k, m, k)
        lay_c = self._layout(t_c, n, m, n)
        pref = ctypes.c_void_p()
        _Cublas._check("cublasLtMatmulPreferenceCreate", lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)))
        limit = ctypes.c_uint64(self.workspace.nbytes)
        _Cublas._check("cublasLtMatmulPreferenceSetAttribute", lib.cublasLtMatmulPreferenceSetAttribute(
            pref, self.PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), ctypes.sizeof(limit)))
        # only algorithms that take the operands' actual alignment (cuBLAS's A, B, C, D: our b, a, c, c)
        for attr, align in zip(self.PREF_MIN_ALIGNMENT, (align_b, align_a, align_c, align_c)):
            value = ctypes.c_uint32(align)
            _Cublas._check("cublasLtMatmulPreferenceSetAttribute", lib.cublasLtMatmulPreferenceSetAttribute(
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
        _Cublas._check("cublasLtMatmul", self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self._one), b.data.ptr, lay_b, a.data.ptr, lay_a, ctypes.byref(self._zero),
            c.data.ptr, lay_c, c.data.ptr, lay_c, ctypes.byref(algo), self.workspace.data.ptr, self.workspace.nbytes,
            cupy.cuda.get_current_stream().ptr))
        return True


def _ptr(a) -> int:
    return a.data.ptr


def _alignment(a) -> int:
    """The largest power of two up to 256 dividing an array's device address (cuBLASLt's alignment classes)."""
    p = _ptr(a)
    return min(256, p & -p) if p else 256


def _adjacent(a, b, c) -> bool:
    """Three equal matrices back to back in memory (W_Q, W_K, W_V in the parameter layout)."""
    return _ptr(b) - _ptr(a) == _ptr(c) - _ptr(b) == a.nbytes


def _blocks(n: int, threads: int) -> int:
    return max(1, -(-n // threads))


class CudaEngine:
    name = "cuda"
    xp = cupy
    attention = "lse"

    def __init__(self, dtype: str = "float32", precision: str = "fp32"):
        if dtype != "float32":
            raise AndreaError(f"dtype '{dtype}': the CUDA engine runs float32 (float64 is the NumPy engine's, for gradient checks)")
        if precision not in PRECISIONS:
            raise AndreaError(f"unknown precision '{precision}'; the CUDA engine runs {', '.join(PRECISIONS)}")
        self.dtype = np.dtype(dtype)
        self.precision = precision
        self.act_dtype = ACT_DTYPES[precision]  # the memory plan's activation dtype
        self.act_vec = 16 // np.dtype(self.act_dtype).itemsize  # ACT_VEC: activations per 16-byte access
        # fp16's narrow range needs the loss scaled up before the backward (Model's dynamic loss scale)
        self.loss_scaling = precision == "fp16"
        self.k = _load_kernels(precision)
        # The engine's own device memory: cuBLAS's workspace and the AdamW decay-range table, allocated
        # here, once (the engine runs ops before any plan exists); a model's plan lists them by name.
        self.cublas_workspace = cupy.empty(CUBLAS_WORKSPACE_BYTES, dtype=np.uint8)
        self.decay_table = cupy.zeros(2 * MAX_DECAY_RANGES, dtype=np.int64)
        self.ln_partials = cupy.zeros(2 * LN_CHUNKS * LN_MAX_C, dtype=np.float32)
        self._decay_ranges: tuple = ()
        self._own = {"cublas_workspace": self.cublas_workspace, "decay_ranges": self.decay_table,
                     "ln_partials": self.ln_partials}
        self.blas = _Cublas(precision, self.cublas_workspace)
        # 16-bit builds: GELU and its gradient as epilogues of the MLP's products (cuBLASLt, same workspace)
        self.blas_lt = _CublasLt(self.cublas_workspace) if self.act_dtype != "float32" else None
        self._capture_streams: list = []

    @property
    def own_buffers(self) -> tuple[BufferSpec, ...]:
        """The engine's own device buffers, for the memory plan."""
        return tuple(BufferSpec(name, a.shape, a.dtype.name, "scratch") for name, a in self._own.items())

    @property
    def own_bytes(self) -> int:
        """Device bytes of the engine's own buffers."""
        return sum(a.nbytes for a in self._own.values())

    def _vec_blocks(self, n: int) -> int:
        """Blocks of an elementwise kernel over n activations: a thread per ACT_VEC of them."""
        return _blocks(-(-n // self.act_vec), ELEMENTWISE_THREADS)

    def _launch(self, name: str, blocks: int, threads: int, *args) -> None:
        self.k[name]((blocks,), (threads,), args)

    # ---- buffers -------------------------------------------------------------------------
    def allocate(self, plan):
        """Every plan buffer, carved from one device allocation (each 256-byte aligned), zero-filled;
        the engine's own buffers, which the plan lists too, are the ones it already holds."""
        carved = [b for b in plan.buffers if b.name not in self._own]
        offsets, total = [], 0
        for b in carved:
            offsets.append(total)
            total += -(-b.nbytes // ALIGN) * ALIGN
        arena = cupy.cuda.alloc(total)
        cupy.cuda.runtime.memsetAsync(arena.ptr, 0, total, cupy.cuda.get_current_stream().ptr)
        bufs = {b.name: cupy.ndarray(b.shape, dtype=b.dtype, memptr=arena + off) for b, off in zip(carved, offsets)}
        bufs.update({b.name: self._own[b.name] for b in plan.buffers if b.name in self._own})
        return bufs

    # ---- graphs ------------------------------------------------------------------------------
    def capture(self, fn):
        """Record the launches fn() makes as a CUDA graph instead of running them (replay() runs it).

        Capture needs a stream of its own; the graph replays on the current stream, after the uploads
        made there. cuBLAS runs on the engine's handle with its preallocated workspace, which capture
        allows (CuPy's own cuBLAS calls it refuses); nothing in fn() may allocate or wait on the host."""
        current = cupy.cuda.get_current_stream()
        current.synchronize()
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                fn()
            finally:
                graph = stream.end_capture()
        self._capture_streams.append(stream)  # the graph's launches were recorded on it; keep it alive
        return graph

    def replay(self, graph) -> None:
        graph.launch(stream=cupy.cuda.get_current_stream())

    def to_host(self, a) -> np.ndarray:
        return cupy.asnumpy(a)

    def upload(self, dst, src) -> None:
        dst.set(np.ascontiguousarray(src, dtype=dst.dtype).reshape(dst.shape))

    def synchronize(self) -> None:
        cupy.cuda.get_current_stream().synchronize()

    def zero(self, buf) -> None:
        cupy.cuda.runtime.memsetAsync(_ptr(buf), 0, buf.nbytes, cupy.cuda.get_current_stream().ptr)

    zero_grads = zero

    def cast(self, dst, src) -> None:
        """dst = src in dst's dtype: the low-precision weight copy, built from the FP32 weights."""
        self._launch("k_cast_params", _blocks(dst.size, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS,
                     dst, src, np.int64(dst.size))

    # ---- embed -----------------------------------------------------------------------------
    def embed_fwd(self, out, tokens, wte, wpe):
        B, T = tokens.shape
        C = wte.shape[1]
        n_pos = B * T
        self._launch("k_embed_fwd", n_pos, EMBED_FWD_THREADS, out, tokens, wte, wpe, np.int64(n_pos), np.int32(T), np.int32(C))

    def embed_bwd(self, dwte, dwpe, dout, tokens):
        B, T = tokens.shape
        C = dwte.shape[1]
        if C > EMBED_BWD_THREADS * EMBED_BWD_COLS:
            raise AndreaError(f"d_model {C} is wider than the embedding backward kernel's "
                              f"{EMBED_BWD_THREADS * EMBED_BWD_COLS} columns")
        self._launch("k_embed_bwd", B * T + T, EMBED_BWD_THREADS,
                     dwte, dwpe, dout, tokens, np.int64(B * T), np.int32(T), np.int32(C))

    # ---- layernorm -------------------------------------------------------------------------
    def layernorm_fwd(self, out, mean, rstd, inp, gamma, beta):
        self._layernorm_fwd(out, mean, rstd, inp, gamma, beta, inp, inp, 0)

    def residual_layernorm_fwd(self, res_out, out, mean, rstd, a, b, gamma, beta):
        """residual_add(res_out, a, b) then layernorm_fwd(out, mean, rstd, res_out, ...), in one pass."""
        self._layernorm_fwd(out, mean, rstd, res_out, gamma, beta, a, b, 1)

    def _layernorm_fwd(self, out, mean, rstd, inp, gamma, beta, a, b, fused):
        C = inp.shape[-1]
        rows = inp.size // C
        self._launch("k_layernorm_fwd", _blocks(rows, LN_THREADS // 32), LN_THREADS,
                     out, mean, rstd, inp, gamma, beta, np.int64(rows), np.int32(C), a, b, np.int32(fused))

    def layernorm_bwd(self, dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd):
        self._layernorm_bwd(dinp, dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd, 0)

    def layernorm_residual_bwd(self, dinp, dbranch, dgamma, dbeta, dout, inp, gamma, mean, rstd):
        """layernorm_bwd, then the residual connection in front of it in place: dinp (the stream's gradient)
        flows on unchanged and dbranch (overwritten) receives it, in one pass."""
        self._layernorm_bwd(dinp, dbranch, dgamma, dbeta, dout, inp, gamma, mean, rstd, 1)

    def _layernorm_bwd(self, dinp, dbranch, dgamma, dbeta, dout, inp, gamma, mean, rstd, fused):
        C = inp.shape[-1]
        if C > LN_MAX_C:
            raise AndreaError(f"d_model {C} is wider than the LayerNorm backward's {LN_MAX_C} columns")
        rows = inp.size // C
        groups = -(-C // (32 * self.act_vec))
        aligned = all(_ptr(a) % 16 == 0 for a in (dinp, dbranch, dout, inp, gamma))
        if groups <= LN_BWD_MAX_GROUPS and C % self.act_vec == 0 and aligned:
            capacity = self.ln_partials.size // (2 * C)  # chunks whose partial sums ln_partials holds
            per_chunk = max(LN_BWD_ROWS, -(-rows // capacity))
            chunks = -(-rows // per_chunk)
            self._launch(f"k_layernorm_bwd_cached{groups}", chunks, LN_BWD_WARPS * 32,
                         dinp, dbranch, self.ln_partials, dout, inp, gamma, mean, rstd, np.int64(rows), np.int32(C),
                         np.int32(per_chunk), np.int32(chunks), np.int32(fused))
        else:
            chunks = LN_CHUNKS
            row_blocks = _blocks(rows, LN_THREADS // 32)
            self._launch("k_layernorm_bwd", row_blocks + LN_CHUNKS * _blocks(C, 32), LN_THREADS,
                         dinp, dbranch, self.ln_partials, dout, inp, gamma, mean, rstd, np.int64(rows), np.int32(C),
                         np.int32(row_blocks), np.int32(fused))
        self._launch("k_layernorm_bwd_sum", _blocks(C, 32), LN_SUM_THREADS, dgamma, dbeta, self.ln_partials,
                     np.int32(C), np.int32(chunks))

    # ---- attn_qkv: Q, K, V projections ----------------------------------------------------
    def attn_qkv_fwd(self, qkv, inp, W_Q, W_K, W_V):
        C = inp.shape[-1]
        N = inp.size // C
        if _adjacent(W_Q, W_K, W_V):
            self.blas.gemm(qkv, inp, W_Q, N, C, C, batch=3, stride_b=C * C, stride_c=N * C)
            return
        for i, W in enumerate((W_Q, W_K, W_V)):
            self.blas.gemm(qkv[i], inp, W, N, C, C)

    def attn_qkv_bwd(self, dinp, dW_Q, dW_K, dW_V, dqkv, inp, W_Q, W_K, W_V, overwrite=False):
        C = inp.shape[-1]
        N = inp.size // C
        if _adjacent(dW_Q, dW_K, dW_V):  # the three C x C weight gradients as one batched product
            self.blas.gemm(dW_Q, inp, dqkv, C, C, N, trans_a=True, beta=1.0, batch=3, stride_b=N * C, stride_c=C * C)
        else:
            for i, dW in enumerate((dW_Q, dW_K, dW_V)):
                self.blas.gemm(dW, inp, dqkv[i], C, C, N, trans_a=True, beta=1.0)
        for i, W in enumerate((W_Q, W_K, W_V)):
            self.blas.gemm(dinp, dqkv[i], W, N, C, C, trans_b=True, beta=0.0 if overwrite and i == 0 else 1.0)

    # ---- attn: causal scaled dot-product attention (fused; kernels/attn.cu) ----------------
    def _attn_shape(self, qkv, n_head):
        _, B, T, C = qkv.shape
        hd = C // n_head
        if hd > ATTN_TILE or hd % 4:
            raise AndreaError(f"head width {hd} (d_model {C} / n_head {n_head}): the fused attention takes a "
                              f"multiple of 4 up to {ATTN_TILE}")
        grid = (B * n_head, -(-T // ATTN_TILE))
        split = self.precision == "fp32"  # 3xTF32 products; tf32 takes one TF32 product
        return grid, (np.int32(B), np.int32(T), np.int32(C), np.int32(n_head), np.float32(1.0 / math.sqrt(hd)),
                      np.int32(split))

    def _bf16_attention(self, qkv, n_head) -> tuple | None:
        """Arguments of kernels/attn_bf16.cu when it takes this shape (bf16 or fp16, head width 64), else None."""
        _, B, T, C = qkv.shape
        if self.precision not in MMA16_ATTENTION or C != ATTN_BF16_HEAD * n_head:
            return None
        return B * n_head, T, (np.int32(B), np.int32(T), np.int32(C), np.int32(n_head),
                               np.float32(1.0 / math.sqrt(ATTN_BF16_HEAD)))

    def attn_fwd(self, out, att, qkv, n_head):
        bf16 = self._bf16_attention(qkv, n_head)
        if bf16:
            heads, T, dims = bf16
            threads, rows, _, _ = self.k["attn_bf16_launch"]
            self.k["k_attn_fwd_bf16"]((heads, -(-T // rows)), (threads,), (out, att, qkv, *dims))
            return
        grid, dims = self._attn_shape(qkv, n_head)
        self.k["k_attn_fwd"](grid, (ATTN_THREADS,), (out, att, qkv, *dims), shared_mem=ATTN_FWD_SMEM)

    def attn_bwd(self, dqkv, datt, dout, qkv, out, att, n_head, overwrite=False):
        add = np.int32(not overwrite)
        bf16 = self._bf16_attention(qkv, n_head)
        if bf16:
            heads, T, dims = bf16
            threads, rows, kv_threads, kv_rows = self.k["attn_bf16_launch"]
            self.k["k_attn_bwd_dq_bf16"]((heads, -(-T // rows)), (threads,), (dqkv, datt, dout, out, qkv, att, *dims, add))
            self.k["k_attn_bwd_bf16"]((heads, -(-T // kv_rows)), (kv_threads,), (dqkv, datt, dout, qkv, att, *dims, add))
            return
        grid, dims = self._attn_shape(qkv, n_head)
        # The first writes D = rowsum(dY * Y) into datt and adds dQ; the second reads D and adds dK, dV.
        self.k["k_attn_bwd_dq"](grid, (ATTN_THREADS,), (dqkv, datt, dout, out, qkv, att, *dims, add),
                                shared_mem=ATTN_BWD_SMEM)
        self.k["k_attn_bwd"](grid, (ATTN_THREADS,), (dqkv, datt, dout, qkv, att, *dims, add), shared_mem=ATTN_BWD_SMEM)

    # ---- attn_out: W_O projection ----------------------------------------------------------
    def attn_out_fwd(self, out, inp, W_O):
        C = inp.shape[-1]
        self.blas.gemm(out, inp, W_O, inp.size // C, C, C)

    def attn_out_bwd(self, dinp, dW_O, dout, inp, W_O, overwrite=False):
        C = inp.shape[-1]
        N = inp.size // C
        self.blas.gemm(dW_O, inp, dout, C, C, N, trans_a=True, beta=1.0)
        self.blas.gemm(dinp, dout, W_O, N, C, C, trans_b=True, beta=0.0 if overwrite else 1.0)

    # ---- mlp: W_1, GELU, W_2 ---------------------------------------------------------------
    def mlp_fwd(self, out, pre, act, inp, W_1, W_2):
        C, F = W_1.shape
        N = inp.size // C
        self._mlp_up(pre, act, inp, W_1)
        self.blas.gemm(out, act, W_2, N, C, F)

    def _mlp_up(self, pre, act, inp, W_1):
        """pre = inp @ W_1 and act = GELU(pre): one cuBLASLt product where the build has it, else two passes."""
        if not self._gelu_epilogue(pre, act, inp, W_1):
            C, F = W_1.shape
            self.blas.gemm(pre, inp, W_1, inp.size // C, F, C)
            self._gelu(act, pre)

    def _gelu_epilogue(self, pre, act, inp, W_1) -> bool:
        """pre = inp @ W_1 and act = GELU(pre) as one cuBLASLt product (GELU_AUX); False where there is none."""
        C, F = W_1.shape
        return self.blas_lt is not None and self.blas_lt.gemm(act, inp, W_1, inp.size // C, F, C, epilogue="gelu_aux",
                                                              aux=pre)

    def _gelu(self, act, pre):
        self._launch("k_mlp_fwd", self._vec_blocks(pre.size), ELEMENTWISE_THREADS, act, pre, np.int64(pre.size))

    def mlp_bwd(self, dinp, dW_1, dW_2, dpre, dout, inp, pre, act, W_1, W_2, recompute=False, overwrite=False):
        """With `recompute`, act is stale (a buffer shared by the layers) and is first rebuilt from pre, or, where
        the GELU is the product's epilogue, by the forward's own product again (the same bits in act and pre)."""
        C, F = W_1.shape
        N = inp.size // C
        if recompute and not self._gelu_epilogue(pre, act, inp, W_1):
            self._gelu(act, pre)
        self.blas.gemm(dW_2, act, dout, F, C, N, trans_a=True, beta=1.0)
        if not (self.blas_lt and self.blas_lt.gemm(dpre, dout, W_2, N, F, C, trans_b=True, epilogue="dgelu", aux=pre)):
            self.blas.gemm(dpre, dout, W_2, N, F, C, trans_b=True)
            self._launch("k_mlp_bwd", self._vec_blocks(N * F), ELEMENTWISE_THREADS, dpre, pre, np.int64(N * F))
        self.blas.gemm(dW_1, inp, dpre, C, F, N, trans_a=True, beta=1.0)
        self.blas.gemm(dinp, dpre, W_1, N, C, F, trans_b=True, beta=0.0 if overwrite else 1.0)

    # ---- residual_add ----------------------------------------------------------------------
    def residual_add(self, out, a, b):
        self._launch("k_residual_add", self._vec_blocks(out.size), ELEMENTWISE_THREADS,
                     out, a, b, np.int64(out.size))

    def residual_add_bwd(self, da, db, dout):
        self._launch("k_residual_add_bwd", self._vec_blocks(dout.size), ELEMENTWISE_THREADS,
                     da, db, dout, np.int64(dout.size))

    # ---- loss: tied projection + softmax cross-entropy ------------------------------------
    def loss_fwd(self, losses, probs, inp, wte, targets):
        V, C = wte.shape
        N = inp.size // C
        self.blas.gemm(probs, inp, wte, N, V, C, trans_b=True)
        self._launch("k_loss_fwd", N, LOSS_THREADS, losses, probs, targets, np.int64(N), np.int32(V))

    def loss_bwd(self, dinp, dwte, dlogits, probs, inp, wte, targets, scale, overwrite=False):
        """Gradient of scale * sum(losses): scale = 1 / (B * T) gives the mean's gradient.

        dlogits = probs - onehot(targets) (scale enters the products); it may be probs itself, turned
        into the gradient in place (only the targets change)."""
        V, C = wte.shape
        N = inp.size // C
        if _ptr(dlogits) == _ptr(probs):
            self._launch("k_loss_bwd_in_place", _blocks(N, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS,
                         probs, targets, np.int64(N), np.int32(V))
        else:
            self._launch("k_loss_bwd", N, LOSS_THREADS, dlogits, probs, targets, np.int64(N), np.int32(V))
        self.blas.gemm(dwte, dlogits, inp, V, C, N, trans_a=True, alpha=scale, beta=1.0)
        self.blas.gemm(dinp, dlogits, wte, N, C, V, alpha=scale, beta=0.0 if overwrite else 1.0)

    def mean_loss(self, losses) -> float:
        return float(cupy.asnumpy(losses).mean(dtype=np.float64))

    # ---- global-norm clipping ---------------------------------------------------------------
    def grad_norm_partial(self, partials, grads):
        chunk = -(-grads.size // partials.size)
        self._launch("k_grad_norm_partial", partials.size, NORM_THREADS,
                     partials, grads, np.int64(grads.size), np.int64(chunk))

    def grad_norm_final(self, norm, partials):
        self._launch("k_grad_norm_final", 1, NORM_THREADS, norm, partials, np.int32(partials.size))

    def grad_scale(self, grads, scale):
        self._launch("k_grad_scale", _blocks(grads.size, ELEMENTWISE_THREADS), ELEMENTWISE_THREADS,
                     grads, np.float32(scale), np.int64(grads.size))

    # ---- AdamW ------------------------------------------------------------------------------
    def adamw_step(self, params, grads, m, v, *, lr, beta1, beta2, eps, weight_decay, step, decay_ranges,
                   params_lp=None):
        """One AdamW update; `step` is 1-based (bias correction); decay only inside decay_ranges.
        `params_lp`, when given, receives the updated weights in its own dtype in the same pass."""
        ranges = tuple((int(s), int(e)) for s, e in decay_ranges)
        if ranges != self._decay_ranges:
            if len(ranges) > MAX_DECAY_RANGES:
                raise AndreaError(f"{len(ranges)} weight-decay ranges; the CUDA engine takes at most {MAX_DECAY_RANGES}")
            if ranges:
                self.decay_table[:2 * len(ranges)].set(np.array(ranges, dtype=np.int64).reshape(-1))
            self._decay_ranges = ranges
        f32 = np.float32
        self._launch("k_adamw", _blocks(-(-params.size // 4), ELEMENTWISE_THREADS), ELEMENTWISE_THREADS,
                     params, grads, m, v, np.int64(params.size), self.decay_table, np.int32(len(ranges)),
                     f32(lr), f32(beta1), f32(1 - beta1), f32(beta2), f32(1 - beta2), f32(eps),
                     f32(weight_decay), f32(1 - beta1**step), f32(1 - beta2**step),
                     params if params_lp is None else params_lp, np.int32(params_lp is not None))
