"""An experiment's step (its micro-batches) on one tree, in this process: median ms of 20 steps after 3.

    python3 dev/cuda/micro_step.py TREE [--shape 120M] [--micro 8] [--n-micro 4] [--precision bf16]

TREE is a folder with andrea/, kernels/ and scripts/ (`git archive REV | tar -x -C TREE`, or `.`); run it for each
tree in turn, a process each, for an A/B of a change that only a step of several micro-batches shows (the
benchmark's step has one): what happens between one micro-batch's launches and the next's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree")
    ap.add_argument("--shape", default="120M", choices=("120M", "12M"))
    ap.add_argument("--micro", type=int, default=8, help="micro-batch size (default 8)")
    ap.add_argument("--n-micro", type=int, default=4, help="micro-batches a step (default 4, the 120M experiment's)")
    ap.add_argument("--precision", default="bf16")
    args = ap.parse_args()
    tree = os.path.abspath(args.tree)
    sys.path[:0] = [tree, os.path.join(tree, "scripts")]
    os.environ["ANDREA_KERNELS"] = os.path.join(tree, "kernels")
    import andrea
    from bench import EXPERIMENTS, OPTIMIZER, lr_at, options

    from andrea.engines.crosscheck import synthetic_micro_batches
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.model import Model, init_params

    if not andrea.__file__.startswith(tree):
        raise SystemExit(f"andrea comes from {andrea.__file__}, not from {tree}: unset PYTHONPATH's copy of it")
    shape = EXPERIMENTS[args.shape].model
    engine = CudaEngine(precision=args.precision)
    model = Model(engine, shape, args.micro, graphs=True, **options(args.shape))
    model.load_state(init_params(model.layout, 0))
    batches = [synthetic_micro_batches(shape, args.micro, args.n_micro, s) for s in range(4)]
    times = []
    for step in range(23):
        t = time.perf_counter()
        model.train_step(batches[step % 4], step=step, lr=lr_at(step), optimizer=OPTIMIZER)
        engine.synchronize()
        times.append(time.perf_counter() - t)
    print(f"{args.shape} {args.precision} {args.n_micro} x {args.micro}, {tree}: "
          f"{statistics.median(times[3:]) * 1e3:.3f} ms a step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
