"""The precisions, one table: what each keeps in which type, and which engine runs it.

fp32 is the reference (the NumPy engine's only precision). On the CUDA engine: tf32 runs the matrix
products on tensor cores with TF32 inputs and FP32 accumulation; bf16 and fp16 are mixed precision
(activations, the activation gradients that feed products or that products write, and a copy of the weights in
16 bits, FP32 accumulation and arithmetic; statistics, the residual stream's gradient, weights, gradients, m and v
FP32);
fp16's narrow range needs the dynamic loss scale. fp8 is bf16 with the products of attn_qkv, the MLP and
the classifier (its logits and input gradient) on FP8 operands (E4M3 activations and weights, E5M2 gradients; andrea/ops/fp8.py), FP32
accumulation; Hopper or Ada (sm_89+). The experiment schema's enum lists the same names
(tests/test_config_layout.py checks).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    name: str
    act_dtype: str  # activations and the weight copy the products read
    tf32_products: bool  # FP32 products on TF32 tensor cores
    loss_scaling: bool  # the model's dynamic loss scale (fp16)
    build_defines: tuple[str, ...]  # the NVRTC build of kernels/*.cu for this precision (act_t in common.cuh)
    fp8_products: bool = False  # the layers' products on FP8 operands (cuBLASLt)

    @property
    def low(self) -> bool:
        """16-bit activations: the mma attention (kernels/attn_bf16.cu) and the cuBLASLt GELU epilogues."""
        return self.act_dtype != "float32"

    @property
    def needs_cuda(self) -> bool:
        return self.name != "fp32"


PRECISIONS = {p.name: p for p in (
    Precision("fp32", "float32", False, False, ()),
    Precision("tf32", "float32", True, False, ()),
    Precision("bf16", "bfloat16", False, False, ("-DACT_BF16",)),
    Precision("fp16", "float16", False, True, ("-DACT_FP16",)),
    Precision("fp8", "bfloat16", False, False, ("-DACT_BF16",), fp8_products=True),
)}
