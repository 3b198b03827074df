"""Engines: the same op-pair API on NumPy (the reference) and on CUDA (CuPy + hand-written kernels).

API (every engine):
    allocate(plan) -> dict[name, array]        once, at start
    to_host(array) -> np.ndarray; upload(dst, np_array); synchronize()
    zero(buf); zero_grads(grads)
    <op>_fwd(...) / <op>_bwd(...)              the seed's 8 op pairs; backward ops ADD (+=) into
                                               both their grad_input and grad_weight buffers; with
                                               overwrite=True (attn_qkv, attn, attn_out, mlp, loss)
                                               they write their grad_input instead
    residual_layernorm_fwd(...)                residual_add, then the layernorm_fwd reading its sum
    layernorm_residual_bwd(dinp, dbranch, ...)  layernorm_bwd, then that residual's backward in place:
                                               dinp flows on, dbranch (overwritten) gets a copy
    grad_norm_partial(partials, grads); grad_norm_final(norm, partials); grad_scale(grads, scale)
    adamw_step(params, grads, m, v, *, lr, beta1, beta2, eps, weight_decay, step, decay_ranges)
"""

from __future__ import annotations

from andrea.errors import AndreaError

ENGINES = ("auto", "numpy", "cuda")


def cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.is_available()
    except Exception:  # no cupy, no driver, no device: all mean "no CUDA here"
        return False


def make_engine(name: str = "auto", dtype: str = "float32", precision: str = "fp32"):
    """Build an engine by name; `auto` picks CUDA when a device is present."""
    if name not in ENGINES:
        raise AndreaError(f"unknown engine '{name}'; choose one of {', '.join(ENGINES)}")
    if name == "auto":
        name = "cuda" if cuda_available() else "numpy"
    if name == "cuda":
        if not cuda_available():
            raise AndreaError("--engine cuda: no CUDA device is visible; use --engine numpy or auto")
        from andrea.engines.cuda_engine import CudaEngine

        return CudaEngine(dtype=dtype, precision=precision)
    if precision != "fp32":
        raise AndreaError(f"precision '{precision}' needs the CUDA engine; the NumPy engine runs fp32 (or float64)")
    from andrea.engines.numpy_engine import NumpyEngine

    return NumpyEngine(dtype=dtype)
