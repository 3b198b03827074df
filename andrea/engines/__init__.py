"""Engines: the same op-pair API on NumPy (the reference) and on CUDA (CuPy + hand-written kernels).

The API, with what an engine declares about itself, is written out once in andrea/engines/protocol.py;
the ops themselves live in andrea/ops/<op>.py. This module picks and builds an engine by name.
"""

from __future__ import annotations

from andrea.common.errors import AndreaError

ENGINES = ("auto", "numpy", "cuda")


def cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.is_available()
    except Exception:  # no cupy, no driver, no device: all mean "no CUDA here"
        return False


def engine_name(name: str) -> str:
    """The engine a setting runs on: `auto` is CUDA when a device is present, else NumPy."""
    if name not in ENGINES:
        raise AndreaError(f"unknown engine '{name}'; choose one of {', '.join(ENGINES)}")
    return ("cuda" if cuda_available() else "numpy") if name == "auto" else name


def make_engine(name: str = "auto", dtype: str = "float32", precision: str = "fp32"):
    """Build an engine by name; `auto` picks CUDA when a device is present."""
    name = engine_name(name)
    if name == "cuda":
        if not cuda_available():
            raise AndreaError("--engine cuda: no CUDA device is visible; use --engine numpy or auto")
        from andrea.engines.cuda_engine import CudaEngine

        return CudaEngine(dtype=dtype, precision=precision)
    if precision != "fp32":
        raise AndreaError(f"precision '{precision}' needs the CUDA engine; the NumPy engine runs fp32 (or float64)")
    from andrea.engines.numpy_engine import NumpyEngine

    return NumpyEngine(dtype=dtype)
