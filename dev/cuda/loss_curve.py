"""The loss curve of an experiment's model on the CUDA engine in several precisions, from the same init.

    PYTHONPATH=. python3 dev/cuda/loss_curve.py [--shape 120M] [--precisions bf16,fp32] [--steps 200] [--every 10]
                                               [--seeds 1337] [--text DIR]

For each of `--seeds`, each precision trains `--steps` steps of the synthetic stream drawn from that seed, from
init_params(seed), at the benchmark's micro-batch with the trainer's memory options (andrea/schedule/crosscheck.py's
train_run, as the parity tests of tests/test_gpu_scale.py run it), and prints its loss every `--every` steps and
its last. With `--text DIR` (a tokens folder with train.bin and val.bin, e.g. the embedded corpus as
tests/conftest.py's embedded_text prepares it) the steps read its text as the text parity test does, and the
held-out loss on val.bin after them is printed too. It reports and does not judge: where two precisions part is
for the reader (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench import BENCH, EXPERIMENTS, options  # noqa: E402

from andrea.schedule.crosscheck import text_training, train_run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", default="120M", choices=sorted(BENCH), help="the experiment (default 120M)")
    ap.add_argument("--precisions", default="bf16,fp32", help="comma-separated (default bf16,fp32)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    ap.add_argument("--every", type=int, default=10, help="print the loss every this many steps (default 10)")
    ap.add_argument("--seeds", default="1337", help="comma-separated init and stream seeds (default 1337, the tests')")
    ap.add_argument("--text", type=Path, help="a tokens folder (train.bin, val.bin): train on its text, not the "
                                              "synthetic stream, and print the held-out loss")
    args = ap.parse_args()
    from andrea.engines.cuda_engine import CudaEngine

    shape, micro = EXPERIMENTS[args.shape].model, BENCH[args.shape]
    text = text_training(args.text, shape.seq_len, micro) if args.text else {}
    for seed in map(int, args.seeds.split(",")):
        for precision in args.precisions.split(","):
            run = train_run(CudaEngine(precision=precision), shape, micro, 1, args.steps, seed=seed,
                            **options(args.shape), **text)
            curve = " ".join(f"{x:.3f}" for x in run.losses[::args.every])
            held = f"  held-out {run.held_out:.4f}" if args.text else ""
            print(f"{args.shape} {precision} seed {seed}{' text' if args.text else ''}: {curve}  last "
                  f"{run.losses[-1]:.4f}{held}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
