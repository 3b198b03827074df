"""A recorded graph's small memset nodes as kernel nodes.

cuBLASLt records a memset of a few bytes of its workspace before some of its products (the batched QKV product,
the GELU epilogues, the FP8 products with an output scale), and a memset node leaves the device idle in the gaps
on either side of it, where one kernel follows another with none (docs/PERFORMANCE.md, "Settings that change
speed", ANDREA_GRAPH_MEMSETS). `without_small_memsets` rewrites a captured graph through CUDA's driver API: each
memset node of at most SMALL_MEMSET_BYTES becomes a k_memset node (kernels/memset.cu) with the same arguments,
dependencies and dependents, and the graph is instantiated again. A larger memset stays a node. The bytes written
are the same, so a step's results are too. ANDREA_GRAPH_MEMSETS=1 keeps every graph as recorded.
"""

from __future__ import annotations

import ctypes
import functools
import os

import cupy

from andrea.common.errors import AndreaError
from andrea.ops.base import blocks, kernel_defines

SMALL_MEMSET_BYTES = 1 << 20  # larger memsets keep their node: one kernel's gaps matter only beside a small one
_MEMSET_BLOCKS = 1024  # k_memset's grid at most (grid-stride past it)
_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty"}  # CUgraphNodeType
_MEMSET = 2


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    p, size = ctypes.c_void_p, ctypes.c_size_t
    for name, args in {
        "cuGraphGetNodes": (p, p, ctypes.POINTER(size)),
        "cuGraphNodeGetType": (p, ctypes.POINTER(ctypes.c_int)),
        "cuGraphMemsetNodeGetParams": (p, ctypes.POINTER(_MemsetParams)),
        # the _v2 calls (CUDA 12.3 on) take edge data; null: the default edges a stream capture records
        "cuGraphNodeGetDependencies_v2": (p, p, p, ctypes.POINTER(size)),
        "cuGraphNodeGetDependentNodes_v2": (p, p, p, ctypes.POINTER(size)),
        "cuGraphAddKernelNode_v2": (ctypes.POINTER(p), p, p, size, ctypes.POINTER(_KernelParams)),
        "cuGraphAddDependencies_v2": (p, p, p, p, size),
        "cuGraphDestroyNode": (p,),
        "cuGraphInstantiateWithFlags": (ctypes.POINTER(p), p, ctypes.c_ulonglong),
        "cuGraphLaunch": (p, p),
        "cuGraphExecDestroy": (p,),
    }.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _call(name: str, *args) -> None:
    result = getattr(_driver(), name)(*args)
    if result != 0:
        raise AndreaError(f"CUDA driver call {name} failed (CUresult {result}) while rewriting a recorded graph; "
                          "ANDREA_GRAPH_MEMSETS=1 keeps graphs as recorded")


def _listed(name: str, *head) -> list[int]:
    """A driver call's node list (cuGraphGetNodes and the dependency queries): its count first, then the nodes."""
    n = ctypes.c_size_t(0)
    edges = (None,) if name != "cuGraphGetNodes" else ()
    _call(name, *head, None, *edges, ctypes.byref(n))
    if n.value == 0:
        return []
    nodes = (ctypes.c_void_p * n.value)()
    _call(name, *head, nodes, *edges, ctypes.byref(n))
    return [nodes[i] for i in range(n.value)]


def _type(node) -> int:
    t = ctypes.c_int(-1)
    _call("cuGraphNodeGetType", node, ctypes.byref(t))
    return t.value


def _memset(node) -> _MemsetParams:
    params = _MemsetParams()
    _call("cuGraphMemsetNodeGetParams", node, ctypes.byref(params))
    return params


def memset_bytes(graph) -> list[int]:
    """Bytes of each memset node of a recorded graph, in the graph's node order."""
    return [m.elementSize * m.width * m.height for m in
            (_memset(n) for n in _listed("cuGraphGetNodes", graph.graph) if _type(n) == _MEMSET)]


def node_kinds(graph) -> dict[str, int]:
    """How many nodes of each kind (kernel, memset, ...) a recorded graph holds."""
    kinds: dict[str, int] = {}
    for node in _listed("cuGraphGetNodes", graph.graph):
        kind = _NODE_TYPES.get(_type(node), "other")
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


class RecordedGraph:
    """A captured graph instantiated again after the rewrite; launch() as CuPy's Graph. The CuPy Graph stays
    referenced here: it owns the cudaGraph_t."""

    def __init__(self, recorded, exec_handle: int):
        self.recorded, self.graph, self._exec = recorded, recorded.graph, exec_handle

    def launch(self, stream=None) -> None:
        _call("cuGraphLaunch", self._exec, (stream or cupy.cuda.get_current_stream()).ptr)

    def __del__(self):
        if self._exec:
            _driver().cuGraphExecDestroy(self._exec)
            self._exec = None


def without_small_memsets(graph, k_memset):
    """The captured CuPy graph with each memset node of at most SMALL_MEMSET_BYTES replaced by a k_memset node (a
    cupy RawKernel) in the same place: a RecordedGraph, or the graph itself where it has none (or
    ANDREA_GRAPH_MEMSETS=1)."""
    if os.environ.get("ANDREA_GRAPH_MEMSETS", "0") == "1":
        return graph
    handle = graph.graph
    small = [(n, m) for n in _listed("cuGraphGetNodes", handle) if _type(n) == _MEMSET
             for m in (_memset(n),) if m.elementSize * m.width * m.height <= SMALL_MEMSET_BYTES]
    if not small:
        return graph
    threads = kernel_defines("memset")["MEMSET_THREADS"]
    for node, m in small:
        before = _listed("cuGraphNodeGetDependencies_v2", node)
        after = _listed("cuGraphNodeGetDependentNodes_v2", node)
        args = (ctypes.c_void_p(m.dst), ctypes.c_uint64(m.pitch), ctypes.c_uint(m.value), ctypes.c_uint(m.elementSize),
                ctypes.c_uint64(m.width), ctypes.c_uint64(m.height))
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        grid = min(_MEMSET_BLOCKS, blocks(m.width * m.height, threads))
        params = _KernelParams(func=k_memset.kernel.ptr, gridDimX=grid, gridDimY=1, gridDimZ=1, blockDimX=threads,
                               blockDimY=1, blockDimZ=1, sharedMemBytes=0, kernelParams=pointers)
        kernel = ctypes.c_void_p()
        deps = (ctypes.c_void_p * max(1, len(before)))(*before)
        _call("cuGraphAddKernelNode_v2", ctypes.byref(kernel), handle, deps, len(before), ctypes.byref(params))
        if after:
            n = len(after)
            _call("cuGraphAddDependencies_v2", handle, (ctypes.c_void_p * n)(*([kernel.value] * n)),
                  (ctypes.c_void_p * n)(*after), None, n)
        _call("cuGraphDestroyNode", node)  # and its edges
    exec_handle = ctypes.c_void_p()
    _call("cuGraphInstantiateWithFlags", ctypes.byref(exec_handle), handle, 0)
    return RecordedGraph(graph, exec_handle.value)
