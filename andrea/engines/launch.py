"""Kernel launches of the CUDA engine: CuPy's, or on Hopper, inside a recorded graph, programmatic dependent launches.

A kernel launched with programmatic stream serialization (cuLaunchKernelEx) may be started by the device before the
kernel ahead of it on the stream has finished: its blocks are placed and reach their first instruction while the
other one's last blocks drain, and each waits there (kernels/common.cuh, PDL_WAIT: griddepcontrol.wait, the first
statement of every kernel of kernels/) until that kernel's stores are visible. The order of every read and write is
the plain launch's, so are the bits; what goes is the device's launch gap between the two kernels. The gap a
cuBLAS product leaves before one of our kernels goes too; one before a cuBLAS product stays (cuBLAS launches its
own kernels).

Only launches recorded into a CUDA graph take it (the step's, the sampler's): an eager launch keeps CuPy's, whose
host cost is lower than ctypes'. On with ANDREA_PDL=1 (not yet the default: docs/PERFORMANCE.md says what it
measured); below compute capability 9.0 there is no such launch.
"""

from __future__ import annotations

import ctypes
import os

import cupy
import numpy as np

from andrea.errors import AndreaError

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h, CUlaunchAttributeID


class _LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes; the member this module sets
    _fields_ = [("bytes", ctypes.c_ubyte * 64), ("programmatic_stream_serialization_allowed", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding to 8 bytes, the value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_ubyte * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


# A kernel argument's C type by its NumPy dtype (the engine passes NumPy scalars and CuPy arrays, as CuPy takes them).
_C_TYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint32): ctypes.c_uint32,
            np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float,
            np.dtype(np.float64): ctypes.c_double}


def pdl_wanted(compute_capability: str) -> bool:
    """Whether a device of this compute capability ("90") records programmatic dependent launches."""
    return int(compute_capability) >= 90 and os.environ.get("ANDREA_PDL", "0") == "1"


def _dims(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int | np.integer) else tuple(d)
    return (*(int(x) for x in d), *(1,) * (3 - len(d)))


def _c_arg(a):
    if isinstance(a, cupy.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, np.generic) and a.dtype in _C_TYPES:
        return _C_TYPES[a.dtype](a.item())
    raise TypeError(f"kernel argument of type {type(a).__name__} ({getattr(a, 'dtype', '')}): pass a CuPy array or a "
                    f"NumPy scalar of {', '.join(str(t) for t in _C_TYPES)}")


_driver = None


def _launch_kernel_ex():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        _driver = lib.cuLaunchKernelEx
    return _driver


def launch_dependent(function, grid, block, args, shared_mem: int = 0, stream=None) -> None:
    """function(*args) (a CuPy RawKernel) launched with programmatic stream serialization on `stream` (the current
    one by default); the kernel must wait (PDL_WAIT) before it touches memory."""
    stream = stream or cupy.cuda.get_current_stream()
    attr = _LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.programmatic_stream_serialization_allowed = 1  # a Union field: set in attr's own memory
    config = _LaunchConfig((ctypes.c_uint * 3)(*_dims(grid)), (ctypes.c_uint * 3)(*_dims(block)), shared_mem,
                           stream.ptr, ctypes.pointer(attr), 1)
    values = [_c_arg(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
    status = _launch_kernel_ex()(ctypes.byref(config), function.kernel.ptr, params, None)
    if status:
        raise AndreaError(f"cuLaunchKernelEx failed (CUresult {status}) for a kernel of grid {_dims(grid)}, "
                          f"block {_dims(block)}, {shared_mem} bytes of shared memory")


class Kernel:
    """A kernel of the engine's build, called as CuPy's RawKernel is (grid, block, args, shared_mem=0): a launch
    recorded into a graph goes as a programmatic dependent launch where `dependent`, any other through CuPy."""

    __slots__ = ("function", "dependent")

    def __init__(self, function, dependent: bool):
        self.function, self.dependent = function, dependent

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        stream = cupy.cuda.get_current_stream()
        if self.dependent and stream.is_capturing():
            launch_dependent(self.function, grid, block, args, shared_mem, stream)
        else:
            self.function(grid, block, args, shared_mem=shared_mem)
