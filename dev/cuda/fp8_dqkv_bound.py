"""What scaling the attention backward's dqkv by a bound known before that backward runs would do to precision fp8's
rounding, on the CPU, before any kernel is written for it.

    PYTHONPATH=. python3 dev/cuda/fp8_dqkv_bound.py [--steps 200] [--width 64 --layers 2 --vocab 512]

precision fp8 casts dqkv (written in bf16 by the attention backward) to E5M2 at the scale of its own amax, in a pass
of its own (andrea/ops/fp8.py: 25 us a layer on an H100, at the copy rate). A scale known before the backward runs
would let its kernels write E5M2 themselves. A bound from the amaxes of q, k, v (A_q, A_k, A_v: the forward's qkv)
and of the attention output's gradient dY (A_y), with sc = 1 / sqrt(d), T the sequence and d the head width: a row
of P sums to 1 and a column to at most T, |dP| <= d A_y A_v, |D_i| <= max_j |dP_ij|, so |dS_ij| <= 2 d A_y A_v P_ij
and |dQ| <= 2 d sc A_y A_v A_k, |dK| <= 2 d sc T A_y A_v A_q, |dV| <= T A_y. E5M2's normal values span 2^30, so a
bound far above the amax still leaves them most of that span (as the MLP backward's dpre bound does, `dgelu_amax`).
The NumPy engine rounds every product operand as andrea/engines/fp8_emulation.py does (act and dqkv at their
histories' scales, as shipped), but dqkv at the bound's scale. It trains the model of tests/test_fp8.py (or a wider one) from the same
init in fp32, as shipped and with the bound, prints the final losses, how far the bound sits above dqkv's amax
(log2) and the share of its nonzero values each rounding flushes to zero, and exits 1 if the bound's run ends more
than 1.5% from fp32 or dqkv passes its bound.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_act_bound import bound_run, rounded_at_bound  # noqa: E402
from fp8_delayed_scaling import model_arguments, references  # noqa: E402

from andrea.engines.fp8_emulation import Fp8EmulationEngine  # noqa: E402

LIMIT = 0.015


def dqkv_bound(qkv: np.ndarray, dout: np.ndarray, n_head: int) -> float:
    """A bound of |dqkv| from the amaxes of q, k, v and dY (the module docstring's)."""
    a_q, a_k, a_v = (float(np.abs(qkv[i]).max()) for i in range(3))
    a_y = float(np.abs(dout).max())
    T, d = qkv.shape[2], qkv.shape[3] // n_head
    sc = 1.0 / math.sqrt(d)
    return max(2 * d * sc * a_y * a_v * a_k, 2 * d * sc * T * a_y * a_v * a_q, T * a_y)


class DqkvBound(Fp8EmulationEngine):
    """The fp8 emulation (act history on) with dqkv cast at dqkv_bound's scale."""

    name = "numpy-fp8-dqkv-bound"

    def __init__(self):
        super().__init__()
        self._dqkv = self._bound = None
        self.slack: list[float] = []  # log2(bound / amax) of each cast at the bound
        self.flushed = [0, 0, 0]  # nonzero values flushed to 0 at the bound's scale, at their own, all

    def attn_bwd(self, dqkv, datt, dout, qkv, out, att, n_head, overwrite=False, dqkv_history=None):
        super().attn_bwd(dqkv, datt, dout, qkv, out, att, n_head, overwrite, dqkv_history)
        self._dqkv, self._bound = dqkv, dqkv_bound(qkv, dout, n_head)

    def attn_qkv_bwd(self, dinp, dW_QKV, dqkv, *a, **kw):
        try:
            super().attn_qkv_bwd(dinp, dW_QKV, dqkv, *a, **kw)
        finally:
            self._dqkv = None

    def fp8_operand(self, a, fmt: str, amax: float | None = None):
        if a is not self._dqkv:  # dqkv at the bound, whatever scale the engine's own rounding would take
            return super().fp8_operand(a, fmt, amax)
        return rounded_at_bound(a, fmt, self._bound, "dqkv", self.slack, self.flushed).astype(self.dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(ap)
    args = ap.parse_args(argv)
    run, ref = references(args, Fp8EmulationEngine(), "as shipped")
    return 0 if bound_run(DqkvBound(), run, ref, "dqkv at the bound's scale") <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
