"""wte's gradient on FP8 or in bf16 under precision fp8: the classifier's forward and backward timed both ways in one
process, on a real step's buffers, at the experiments' shapes. Run on a CUDA machine with FP8 (sm_89+).

    PYTHONPATH=. python3 dev/cuda/fp8_dwte_ab.py [--shapes 12M,120M] [--rounds 3]

The classifier's backward under precision fp8 takes wte's gradient d_logits^T x on FP8 operands: the transpose of
the forward's E5M2 d_logits (k_fp8_transpose) and x^T in E4M3 (andrea/ops/loss.py, `_dwte_fp8`). The other way is
the bf16 product of the bf16 d_logits. A model of the shape at the benchmark's micro-batch runs one eager step
through an OpRecorder; then loss_fwd + loss_bwd of its first classifier piece, on its own buffers, are timed in a
CUDA graph (andrea/timing.py, graph_ms), the two ways alternating for --rounds rounds. It prints each round's ms
and the median difference, and exits 1 when a way failed to run (a product without an algorithm falls back).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench import BENCH, EXPERIMENTS, options  # noqa: E402

from andrea.engines.crosscheck import OPTIMIZER, lr_at, synthetic_micro_batches  # noqa: E402
from andrea.timing import OpRecorder, graph_ms  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="12M,120M", help="comma-separated: 12M, 120M")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two ways (default 3)")
    args = ap.parse_args()

    from andrea.engines.cuda_engine import CudaEngine
    from andrea.model import Model, init_params

    ok = True
    for name in args.shapes.split(","):
        shape, micro = EXPERIMENTS[name].model, BENCH[name]
        engine = CudaEngine(precision="fp8")
        recorder = OpRecorder(engine)
        model = Model(recorder, shape, micro, graphs=False, **options(name, "fp8"))
        model.load_state(init_params(model.layout, 0))
        model.train_step(synthetic_micro_batches(shape, micro, 1, 0), step=0, lr=lr_at(0), optimizer=OPTIMIZER)
        calls = recorder.first_calls()
        (fa, fk), (ba, bk) = calls["loss_fwd"], calls["loss_bwd"]
        fp8_dwte = type(engine)._dwte_fp8
        ran = []

        def counted(self, *a, **k):
            done = fp8_dwte(self, *a, **k)
            ran.append(done)
            return done

        def bf16(self, *a, **k):
            return False

        times = {"fp8": [], "bf16": []}
        for _ in range(args.rounds):
            for way, method in (("fp8", counted), ("bf16", bf16)):
                type(engine)._dwte_fp8 = method
                times[way].append(graph_ms(engine, lambda: (engine.loss_fwd(*fa, **fk), engine.loss_bwd(*ba, **bk))))
        type(engine)._dwte_fp8 = fp8_dwte
        if not ran or not all(ran):
            print(f"{name}: wte's FP8 gradient did not run in every recording ({ran})", file=sys.stderr)
            ok = False
        rows = ba[2].size // shape.vocab_size
        fp8_ms, bf16_ms = statistics.median(times["fp8"]), statistics.median(times["bf16"])
        print(f"{name} (a piece of {rows} rows, V {shape.vocab_size}): loss_fwd + loss_bwd, dwte on FP8 "
              f"{' / '.join(f'{t:.4f}' for t in times['fp8'])} ms, in bf16 {' / '.join(f'{t:.4f}' for t in times['bf16'])}"
              f" ms; median FP8 - bf16 {fp8_ms - bf16_ms:+.4f} ms a piece", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
