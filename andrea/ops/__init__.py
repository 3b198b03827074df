"""The op pairs, one module each beside its kernels/<op>.cu (andrea/ops/base.py says what a module holds).

The engines are these modules' halves put together: NumpyEngine mixes in every `NumpyOps`, CudaEngine
every `CudaOps`. Everything else about an op — its kernels, its device buffers, its cost, its
cross-check — is asked of its module through the functions here.
"""

from __future__ import annotations

from andrea.ops import adamw, attn, attn_out, attn_qkv, embed, fp8, grad_norm, layernorm, loss, memset, mlp, residual_add

# In the seed's order, then the utilities of the optimizer step, the FP8 casts and the recorded graphs' memsets.
MODULES = (embed, layernorm, attn_qkv, attn, attn_out, mlp, residual_add, loss, grad_norm, adamw, fp8, memset)

# Each engine call of a training step, and the module that owns it (its cost).
CALLS = {
    "embed_fwd": embed, "embed_bwd": embed,
    "layernorm_fwd": layernorm, "layernorm_bwd": layernorm,
    "residual_layernorm_fwd": layernorm, "layernorm_residual_bwd": layernorm,
    "attn_qkv_fwd": attn_qkv, "attn_qkv_bwd": attn_qkv,
    "attn_fwd": attn, "attn_bwd": attn,
    "attn_out_fwd": attn_out, "attn_out_bwd": attn_out,
    "mlp_fwd": mlp, "mlp_bwd": mlp,
    "residual_add": residual_add, "residual_add_bwd": residual_add,
    "loss_fwd": loss, "loss_bwd": loss,
    "grad_norm_partial": grad_norm, "grad_norm_final": grad_norm,
    "adamw_step": adamw, "cast": adamw,
}


def kernel_files() -> dict[str, tuple[str, ...]]:
    """kernels/<file>.cu -> the kernels the engine loads from it."""
    return {name: kernels for m in MODULES for name, kernels in m.KERNELS.items()}


def hopper_kernel_files() -> dict[str, tuple[str, ...]]:
    """kernels/<file>.cu -> the kernels its Hopper build (kernels_build.HOPPER_ARCH) adds to kernel_files()'s."""
    return {name: kernels for m in MODULES for name, kernels in getattr(m, "HOPPER_KERNELS", {}).items()}


def engine_buffers() -> tuple:
    """The device buffers the CUDA engine keeps for its ops (BufferSpecs, role engine)."""
    return tuple(spec for m in MODULES for spec in m.engine_buffers())


def op_cost(call: str, shape, B: int, n_params: int, act_bytes: int = 4) -> tuple[float, float]:
    """(FLOPs, fewest device bytes) of one call: each input read once, each output written once, every
    element at the activations' size (act_bytes) except the optimizer's."""
    return CALLS[call].cost(call, B, shape.seq_len, shape.d_model, shape.n_head, shape.vocab_size, n_params, act_bytes)


def case_names() -> tuple[str, ...]:
    """Every cross-check case: each op's, then the backward ops that write their gradients instead of adding
    into them (`name/overwrite`: overwrite and overwrite_weights on, each gradient the op writes starts as NaN,
    so an element it fails to write shows)."""
    plain = tuple(c for m in MODULES for c in m.CASES)
    return plain + tuple(f"{c}/overwrite" for m in MODULES for c in m.OVERWRITE_CASES)


def case_module(name: str):
    for m in MODULES:
        if name in m.CASES:
            return m
    raise ValueError(f"unknown op {name!r}; one of {case_names()}")
