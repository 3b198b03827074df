"""CUDA engine: the NumPy engine's API on CuPy, with the kernels of kernels/*.cu and cuBLAS.

The ops are the `CudaOps` halves of andrea/ops/<op>.py (each beside its kernels/<op>.cu); this class
loads the kernels, holds the cuBLAS handles and the ops' own device buffers, carves the memory plan and
records CUDA graphs. Arrays are CuPy views into buffers allocated once from the memory plan
(contiguous, row-major, the NumPy engine's shapes). Backward ops ADD into their grad buffers (weight-
gradient products run with beta = 1), the input's gradient too unless `overwrite` (then it is written:
beta = 0, no memset first); scratch arguments are overwritten.

Nothing is allocated on the device after construction and `allocate`: kernels write into the
caller's buffers, cuBLAS runs on the engine's own handle with a preallocated workspace, and host
reads copy into host memory. Every reduction runs in a fixed order: the same inputs give the same
bits on every run.

Precision (andrea/spec/precision.py): each precision is its own NVRTC build of kernels/*.cu (the
activation type act_t, kernels/common.cuh). Weights, m and v are FP32 in every precision: the
checkpoint is the same. The fp32 attention kernels use the tensor cores too, in "3xTF32" (each operand
split into two TF32 parts, three products: FP32-level accuracy).
"""

from __future__ import annotations

import cupy
import ml_dtypes  # noqa: F401  (registers NumPy's "bfloat16" dtype, which the bf16 buffers use)
import numpy as np

from andrea import ops
from andrea.engines.cublas import Cublas, CublasLt
from andrea.engines.graphs import without_small_memsets
from andrea.engines.protocol import EngineTraits
from andrea.common.errors import AndreaError
from andrea.ops.kernels_build import HOPPER_ARCH, build_options, cached_cubin, hopper_build_wanted, kernel_dir, kernel_source
from andrea.spec.memory import PERSISTENT_ROLES, BufferSpec, carve, split_shared
from andrea.ops import adamw, attn, attn_out, attn_qkv, embed, fp8, grad_norm, layernorm, loss, mlp, residual_add
from andrea.ops.base import ELEMENTWISE_THREADS, blocks, ptr
from andrea.spec.precision import PRECISIONS

ALIGN = 256  # bytes: every plan buffer starts on this boundary inside the one device allocation
CUBLAS_WORKSPACE_BYTES = 32 * 2**20  # cuBLAS's recommended workspace on Hopper
STAGING_BUFFERS = 16  # pinned host buffers of staged uploads kept (three a model: tokens, targets, weights)

_modules: dict[tuple[str, str, tuple[str, ...], bool], cupy.RawModule] = {}  # (folder, file, options, Hopper build)


def _module_ints(module: cupy.RawModule, symbol: str, n: int) -> tuple[int, ...]:
    """A kernel module's int[n] constant: what the compiler saw, not a copy of the file's #defines."""
    return tuple(int(x) for x in cupy.ndarray((n,), np.int32, memptr=module.get_global(symbol)).get())


def _load_kernels(precision: str, hopper_kernels: bool) -> dict:
    """Every kernel of one precision's build, compiled once per process (and cached on disk by CuPy,
    keyed by source and options; with hopper_kernels, the files with a Hopper build of their own from
    kernels_build.cached_cubin)."""
    folder = kernel_dir()
    options = build_options(precision)
    hopper = ops.hopper_kernel_files() if hopper_kernels else {}
    functions = {}
    for op, names in ops.kernel_files().items():
        if op == attn.MMA16_KERNEL_FILE and not PRECISIONS[precision].low:
            continue
        own_build = op in hopper  # its kernels, and Hopper's own ones beside them
        key = (str(folder), op, options, own_build)
        if key not in _modules:
            if own_build:
                cubin = cached_cubin(op, HOPPER_ARCH, precision, folder=folder)
                _modules[key] = cupy.RawModule(path=str(cubin))
            else:
                _modules[key] = cupy.RawModule(code=kernel_source(op, folder), options=options, backend="nvrtc")
        if own_build:
            names = (*names, *hopper[op])
        functions.update({name: _modules[key].get_function(name) for name in names})
        if op == attn.MMA16_KERNEL_FILE:
            functions["attn_bf16_launch"] = _module_ints(_modules[key], "attn_bf16_launch", 4)
            if own_build:  # the dynamic shared memory of Hopper's dK / dV kernel
                (smem,) = _module_ints(_modules[key], attn.WG_KV_SMEM_SYMBOL, 1)
                functions[attn.WG_KV_SMEM_SYMBOL] = smem
                functions[attn.HOPPER_KERNELS[op][2]].max_dynamic_shared_size_bytes = smem
    # Over 48 KB of dynamic shared memory needs the limit raised per kernel; the largest shared-memory
    # carveout lets 3-4 attention blocks share an SM.
    for name, smem in attn.shared_memory().items():
        functions[name].max_dynamic_shared_size_bytes = smem
        functions[name].preferred_shared_memory_carveout = 100
    for name in (*attn.KERNELS[attn.MMA16_KERNEL_FILE], *attn.HOPPER_KERNELS[attn.MMA16_KERNEL_FILE]):
        if name in functions:
            functions[name].preferred_shared_memory_carveout = 100
    return functions


class CudaEngine(embed.CudaOps, layernorm.CudaOps, attn_qkv.CudaOps, attn.CudaOps, attn_out.CudaOps,
                 mlp.CudaOps, residual_add.CudaOps, loss.CudaOps, grad_norm.CudaOps, adamw.CudaOps, fp8.CudaOps):
    name = "cuda"
    xp = cupy

    def __init__(self, dtype: str = "float32", precision: str = "fp32", hopper_kernels: bool | None = None):
        """`hopper_kernels`: load the warpgroup (sm_90a) kernels; default: on Hopper unless ANDREA_WGMMA=0. False runs
        the build every sm_80+ card runs (the same bits), on any card."""
        if dtype != "float32":
            raise AndreaError(f"dtype '{dtype}': the CUDA engine runs float32 (float64 is the NumPy engine's, for gradient checks)")
        if precision not in PRECISIONS:
            raise AndreaError(f"unknown precision '{precision}'; the CUDA engine runs {', '.join(PRECISIONS)}")
        p = PRECISIONS[precision]
        if p.fp8_products:
            cc = cupy.cuda.Device().compute_capability  # "90" on Hopper
            if int(cc) < 89:
                raise AndreaError(f"precision fp8 needs FP8 tensor cores (sm_89 or newer); this GPU is sm_{cc}: "
                                  "train in bf16")
        self.fp8 = p.fp8_products
        self.dtype = np.dtype(dtype)
        self.precision = precision
        self.act_vec = 16 // np.dtype(p.act_dtype).itemsize  # ACT_VEC: activations per 16-byte access
        if hopper_kernels is None:
            hopper_kernels = hopper_build_wanted(cupy.cuda.Device().compute_capability)
        elif hopper_kernels and cupy.cuda.Device().compute_capability != "90":
            raise AndreaError("hopper_kernels: the warpgroup kernels need sm_90 (H100, H200)")
        self.k = _load_kernels(precision, hopper_kernels)
        # The engine's own device memory, allocated here, once (the engine runs ops before any plan
        # exists): cuBLAS's workspace and its ops' buffers; a model's plan lists them by name.
        own = (BufferSpec("cublas_workspace", (CUBLAS_WORKSPACE_BYTES,), "uint8", "engine"), *ops.engine_buffers())
        self.own = {b.name: cupy.zeros(b.shape, dtype=b.dtype) for b in own}
        self.traits = EngineTraits(attention="lse", act_dtype=p.act_dtype, loss_scaling=p.loss_scaling, graphs=True,
                                   own_buffers=own, fp8_products=p.fp8_products, fp8_histories=p.fp8_products,
                                   qkv_weight_rows=not p.fp8_products)  # fp8 keeps its own [C, 3C] copy
        self._decay_ranges: tuple = ()
        # 16-bit builds: GELU and its gradient as epilogues of the MLP's products (cuBLASLt, same workspace);
        # fp8: the layers' FP8 products; both: the plain products the algorithm table names
        self.blas_lt = CublasLt(self.own["cublas_workspace"]) if p.low else None
        self.blas = Cublas(p.tf32_products, self.own["cublas_workspace"], lt=self.blas_lt)
        self._capture_streams: list = []
        self._staging: dict = {}  # (dst pointer, bytes) -> (pinned memory, its array, copy's event): upload(staged)
        self._retired: list = []  # engine buffers replaced by larger ones (_hold_plan_buffers)
        self._qkv_rows: dict = {}  # W_QKV's pointer -> its [C, 3C] copy (ops/attn_qkv.py, prepare_qkv_rows)
        # the weights' FP8 copies, a pass's amax book, the casts and FP8 products (ops/fp8.py), in every precision:
        # the ops tell it what they write, and outside precision fp8 it keeps nothing
        self.fp8_book = fp8.Fp8Book(self)

    @property
    def own_bytes(self) -> int:
        """Device bytes of the engine's own buffers."""
        return sum(a.nbytes for a in self.own.values())

    def vec_blocks(self, n: int) -> int:
        """Blocks of an elementwise kernel over n activations: a thread per ACT_VEC of them."""
        return blocks(-(-n // self.act_vec), ELEMENTWISE_THREADS)

    def launch(self, name: str, grid: int, threads: int, *args) -> None:
        """Kernel `name` on a 1-D grid of 1-D blocks, on the current stream."""
        self.k[name]((grid,), (threads,), args)

    # ---- buffers -------------------------------------------------------------------------
    def allocate(self, plan, share=None):
        """Every plan buffer, carved from one device allocation (each 256-byte aligned), zero-filled;
        the engine's own buffers, which the plan lists too, are the ones it already holds.

        `share` = (buffers, plan) of another model on this engine: the plan's weights are that model's, and
        its transient buffers are carved from that model's transient span (memory.carve puts it last),
        which this model may use between that one's steps; nothing is allocated (ValueError if it does
        not fit)."""
        self._hold_plan_buffers(plan)
        self.fp8_book.drop_weight_table()  # a new params_fp8 (zero-filled) holds no table until one is written
        own = {b.name: self.own[b.name] for b in plan.buffers if b.name in self.own}
        if share is not None:
            other_bufs, other_plan = share
            bufs, transient = split_shared(plan, other_bufs, other_plan, self.own)
            start, size = self._transient_span(other_bufs, other_plan)
            _, offsets, total = carve(transient, lambda b: b.nbytes, ALIGN)
            if total > size:
                raise ValueError(f"the transient buffers need {total:,} bytes, the shared model's span has {size:,}")
            bufs.update({b.name: cupy.ndarray(b.shape, dtype=b.dtype, memptr=start + off)
                         for b, off in zip(transient, offsets)})
            return {**bufs, **own}
        carved, offsets, total = carve([b for b in plan.buffers if b.name not in self.own], lambda b: b.nbytes, ALIGN)
        arena = cupy.cuda.alloc(total)
        cupy.cuda.runtime.memsetAsync(arena.ptr, 0, total, cupy.cuda.get_current_stream().ptr)
        bufs = {b.name: cupy.ndarray(b.shape, dtype=b.dtype, memptr=arena + off) for b, off in zip(carved, offsets)}
        return {**bufs, **own}

    def _hold_plan_buffers(self, plan) -> None:
        """Engine buffers that a model's plan sizes (fp8_operands): allocated here for the first plan that names
        one, again (larger) for a plan that needs more; the earlier one stays held, since graphs recorded on it
        still read it."""
        for b in plan.buffers:
            if b.role == "engine" and (b.name not in self.own or self.own[b.name].nbytes < b.nbytes):
                if b.name in self.own:
                    self._retired.append(self.own[b.name])
                self.own[b.name] = cupy.zeros(b.shape, dtype=b.dtype)

    def _transient_span(self, bufs, plan):
        """(pointer, bytes) of the transient buffers allocate() carved for `plan`: the end of its allocation."""
        carved, offsets, total = carve([b for b in plan.buffers if b.name not in self.own], lambda b: b.nbytes, ALIGN)
        first = next((i for i, b in enumerate(carved) if b.role not in PERSISTENT_ROLES), len(carved))
        if first == len(carved):
            raise ValueError("the shared model has no transient buffers")
        return bufs[carved[first].name].data, total - offsets[first]

    # ---- graphs ------------------------------------------------------------------------------
    def capture(self, fn, priority: int | None = None):
        """Record the launches fn() makes as a CUDA graph instead of running them (replay() runs it).

        Capture needs a stream of its own (`priority`: CUDA's, lower sooner; None, the default); the graph
        replays on the current stream, after the uploads made there. cuBLAS runs on the engine's handle with its
        preallocated workspace, which capture allows (CuPy's own cuBLAS calls it refuses); nothing in fn() may
        allocate or wait on the host. Its small memset nodes (cuBLASLt's) are kernel nodes in the graph returned
        (engines/graphs.py)."""
        current = cupy.cuda.get_current_stream()
        current.synchronize()
        stream = cupy.cuda.Stream(non_blocking=True, priority=priority)
        with stream:
            stream.begin_capture()
            try:
                fn()
            finally:
                graph = stream.end_capture()
        self._capture_streams.append(stream)  # the graph's launches were recorded on it; keep it alive
        return without_small_memsets(graph, self.k["k_memset"])

    def replay(self, graph) -> None:
        graph.launch(stream=cupy.cuda.get_current_stream())

    def to_host(self, a, out: np.ndarray | None = None) -> np.ndarray:
        """`a` as a new host array, or copied into `out` (contiguous, a's dtype and shape)."""
        return cupy.asnumpy(a, out=out)

    def upload(self, dst, src, staged: bool = False) -> None:
        """dst = src. `staged` (a step's inputs): through a pinned host buffer of dst's own, copied in stream order
        while the host goes on: a pageable copy waits for the device to finish all work before it, so the step's
        launches (and its next micro-batch's) would wait for it with the device idle. A staging buffer is written
        again only after its last copy ran (its event)."""
        self.fp8_book.wrote(dst)
        if not staged:
            dst.set(np.ascontiguousarray(src, dtype=dst.dtype).reshape(dst.shape))
            return
        key = (ptr(dst), dst.nbytes)
        if key not in self._staging:
            if len(self._staging) >= STAGING_BUFFERS:  # models come and go on one engine: keep the last few
                for *_, copied in self._staging.values():
                    copied.synchronize()
                self._staging.clear()
            pinned = cupy.cuda.alloc_pinned_memory(dst.nbytes)
            host = np.frombuffer(pinned, dtype=dst.dtype, count=dst.size).reshape(dst.shape)
            self._staging[key] = (pinned, host, cupy.cuda.Event(block=False, disable_timing=True))
        _, host, copied = self._staging[key]
        copied.synchronize()
        host[...] = np.reshape(src, dst.shape)  # converted as it is copied into the pinned buffer: one pass
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(ptr(dst), host.ctypes.data, dst.nbytes, cupy.cuda.runtime.memcpyHostToDevice,
                                      stream.ptr)
        copied.record(stream)

    def synchronize(self) -> None:
        cupy.cuda.get_current_stream().synchronize()

    def zero(self, buf) -> None:
        self.fp8_book.wrote(buf)
        cupy.cuda.runtime.memsetAsync(ptr(buf), 0, buf.nbytes, cupy.cuda.get_current_stream().ptr)

    zero_grads = zero
