"""What scaling the MLP's act by a bound known before its product would do to precision fp8's rounding, on the CPU,
before any kernel is written for it.

    PYTHONPATH=. python3 dev/cuda/fp8_act_bound.py [--steps 200] [--width 64 --layers 2 --vocab 512]

precision fp8 casts act = GELU(pre), pre = x W_1, at the scale of its own amax: a pass over act before its cast
(andrea/ops/fp8.py). A scale known before the product would let the GELU epilogue write act in E4M3 itself. Both
bounds here hold for the product of the FP8 operands x and W_1 (|GELU(p)| <= max(|p|, 0.17)):
- "rows": the largest row norm of x times the largest column norm of W_1 (Cauchy-Schwarz);
- "amax": sqrt(C) times x's amax times the largest column norm of W_1 (x's amax is known from the LayerNorm that
  writes it, W_1's column norms from the weights' cast after each update).
The NumPy engine rounds every product operand as andrea/engines/fp8_emulation.py does, but act (in the forward and
in the backward's dW_2) at the scale of a bound. It trains the model of tests/test_fp8.py (or a wider one) from the
same init in fp32, with current scaling and with each bound, prints the final losses, how far each bound sits
above act's amax (log2, mean and largest over the casts) and the share of act's nonzero values each rounding
flushes to zero, and exits 1 if a bound's run ends more than 1.5% from fp32 (the issue's fp8 bar).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_delayed_scaling import model_arguments, references  # noqa: E402

from andrea.engines.crosscheck import train_run  # noqa: E402
from andrea.engines.fp8_emulation import Fp8EmulationEngine  # noqa: E402
from andrea.ops import fp8  # noqa: E402

LIMIT = 0.015
GELU_FLOOR = 0.17  # |GELU(p)| <= max(|p|, 0.17): its least value is about -0.170 (at p = -0.75)
BOUNDS = ("rows", "amax")


def act_bound(inp: np.ndarray, W_1: np.ndarray, kind: str) -> float:
    """A bound of |GELU(x W_1)| over the FP8 operands as the products read them."""
    C = W_1.shape[0]
    x = fp8.fake_quantize(np, inp.reshape(-1, C), "e4m3")
    w = fp8.fake_quantize(np, W_1, "e4m3")
    columns = float(np.sqrt((w.astype(np.float64) ** 2).sum(axis=0)).max())
    if kind == "rows":
        rows = float(np.sqrt((x.astype(np.float64) ** 2).sum(axis=1)).max())
    else:
        rows = float(np.sqrt(C) * np.abs(x).max())
    return max(rows * columns, GELU_FLOOR)


class ActBound(Fp8EmulationEngine):
    """The fp8 emulation with the MLP's act cast at the scale of a bound (`kind`, one of BOUNDS)."""

    name = "numpy-fp8-act-bound"

    def __init__(self, kind: str):
        super().__init__(histories=False)  # the bound in place of act's own amax, as the study began
        self.kind = kind
        self._act = self._bound = None
        self.slack: list[float] = []  # log2(bound / amax) of each forward cast
        self.flushed = [0, 0, 0]  # nonzero act values: flushed to 0 at the bound's scale, at their own, all

    def mlp_fwd(self, out, pre, act, inp, W_1, W_2, recompute=False, **kw):
        self._act, self._bound = act, act_bound(inp, W_1, self.kind)
        super().mlp_fwd(out, pre, act, inp, W_1, W_2, recompute, **kw)
        self._act = None

    def mlp_bwd(self, dinp, dW_1, dW_2, dpre, dout, inp, pre, act, W_1, W_2, **kw):
        self._act, self._bound = act, act_bound(inp, W_1, self.kind)  # the forward's operands: its bound
        super().mlp_bwd(dinp, dW_1, dW_2, dpre, dout, inp, pre, act, W_1, W_2, **kw)
        self._act = None

    def fp8_operand(self, a, fmt: str, amax: float | None = None):
        if a is not self._act or amax is not None:
            return super().fp8_operand(a, fmt, amax)
        return rounded_at_bound(a, fmt, self._bound, "act", self.slack, self.flushed).astype(self.dtype)


def rounded_at_bound(a, fmt: str, bound: float, what: str, slack: list, flushed: list, room: float = 0.0):
    """a's FP8 rounding (fake_quantize) at the scale of `bound`, after checking that a's amax is at most bound * (1 +
    room); log2(bound / amax) goes into `slack`, and `flushed` counts a's nonzero values that round to 0 at the
    bound's scale, at a's own, and all of them."""
    x = np.asarray(a, dtype=np.float32)
    own = fp8.own_amax(np, x)
    if own > bound * (1 + room):
        raise AssertionError(f"{what}'s amax {own} over its bound {bound}")
    q = fp8.fake_quantize(np, x, fmt, bound)
    if own > 0:
        slack.append(float(np.log2(bound / own)))
        nonzero = x != 0
        flushed[0] += int((nonzero & (q == 0)).sum())
        flushed[1] += int((nonzero & (fp8.fake_quantize(np, x, fmt) == 0)).sum())
        flushed[2] += int(nonzero.sum())
    return q


def bound_run(engine, run: dict, ref: float, what: str) -> float:
    """Train a study engine (its `slack` and `flushed` kept by rounded_at_bound) on `run`, print its final loss against
    fp32's `ref`, how far its bound sat over the amax and the share of nonzero values its scale flushed to 0; its
    relative distance from ref (inf where nothing was rounded at the bound)."""
    loss = train_run(engine, **run).losses[-1]
    if not engine.slack:
        print(f"fp8, {what}: nothing was rounded at the bound", flush=True)
        return math.inf
    lost, own, total = engine.flushed
    print(f"fp8, {what} {loss:.6f} ({(loss - ref) / ref:+.3%}); the bound over the amax: "
          f"2^{np.mean(engine.slack):.2f} on average, 2^{np.max(engine.slack):.2f} at most, over {len(engine.slack)} "
          f"casts; nonzero values flushed to 0: {lost / max(total, 1):.4%} (at their own scale "
          f"{own / max(total, 1):.4%})", flush=True)
    return abs(loss - ref) / ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(ap)
    ap.add_argument("--bounds", default=",".join(BOUNDS), help=f"bounds to try, comma-separated (default {BOUNDS})")
    args = ap.parse_args(argv)
    run, ref = references(args)
    worst = max(bound_run(ActBound(kind), run, ref, f"act at the '{kind}' bound's scale")
                for kind in args.bounds.split(","))
    return 0 if worst <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
