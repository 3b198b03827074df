"""The NumPy engine with precision fp8's rounding: every product of attn_qkv and mlp, and the
classifier's logits and input gradient (on unweighted d_logits, the weights then scaling its rows), reads its operands rounded to FP8 as the CUDA engine casts them (andrea/ops/fp8.py: one power-of-two scale per tensor,
E4M3 activations and weights, E5M2 gradients; in a training model's passes the MLP's act and the attention's dqkv
at their histories' scales), in float32 otherwise. It isolates what the FP8 rounding
alone does to training, on the CPU and at any shape (tests/test_fp8_emulation.py)."""

from __future__ import annotations

import dataclasses

import numpy as np

from andrea.engines.numpy_engine import NumpyEngine
from andrea.ops import fp8


class Fp8EmulationEngine(NumpyEngine):
    name = "numpy-fp8"

    def __init__(self, *args, histories: bool = True, **kwargs):
        """`histories` False: act and dqkv at their own amax in training passes too (current scaling throughout)."""
        super().__init__(*args, **kwargs)
        self.traits = dataclasses.replace(self.traits, fp8_histories=histories)

    def fp8_operand(self, a, fmt: str, amax: float | None = None):
        return fp8.fake_quantize(np, a, fmt, amax).astype(self.dtype)
