"""Data-parallel scaling: tokens/s per GPU on N GPUs against one GPU, measured in one run.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 scripts/bench_parallel.py --gpus 2 [--shape 120M] [--batch 8]

Each rank trains the experiment's model (its precision and memory options) at --batch sequences per GPU on
synthetic batches, its flat gradient all-reduced through NCCL every step (andrea.run.parallel.DataParallel, as
`andrea train --gpus N` does). The one-GPU run is the plain engine, no NCCL. Efficiency = tokens/s of the N
GPUs / (N x tokens/s of one). Prints one JSON line per run and a summary; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WARMUP, TIMED = 3, 10


def worker(args) -> None:
    """One rank (or the single-GPU run): time TIMED steps after WARMUP, print rank 0's median."""
    import cupy

    from andrea.spec.config import load_experiment
    from andrea.schedule.crosscheck import OPTIMIZER, lr_at, synthetic_micro_batches
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.schedule.model import Model, init_params
    from andrea.run.parallel import DataParallel, rank_from_env

    exp = load_experiment(REPO / "config" / "experiments" / f"ANDREA-{args.shape}-TRAIN.json")
    rank = rank_from_env()
    if rank:
        cupy.cuda.Device(rank.local).use()
    dp = DataParallel(rank, bytes.fromhex(os.environ["ANDREA_NCCL_ID"])) if rank else None
    model = Model(CudaEngine(precision=exp.precision), exp.model, args.batch, data_parallel=dp,
                  **exp.memory_options)
    model.load_state(init_params(model.layout, exp.seed))
    r = rank.rank if rank else 0
    times = []
    for step in range(WARMUP + TIMED):
        batches = synthetic_micro_batches(exp.model, args.batch, 1, step, seed=r)
        t0 = time.perf_counter()
        model.train_step(batches, step=step, lr=lr_at(step), optimizer=OPTIMIZER)
        model.engine.synchronize()
        times.append(time.perf_counter() - t0)
    if r == 0:
        ms = statistics.median(times[WARMUP:]) * 1e3
        world = rank.world if rank else 1
        tokens = world * args.batch * exp.model.seq_len
        print(json.dumps({"gpus": world, "batch_per_gpu": args.batch, "ms_per_step": round(ms, 2),
                          "tokens_per_s": round(tokens / ms * 1e3)}), flush=True)


def run(args, n: int) -> dict:
    from andrea.run.parallel import LOCAL_ENV, NCCL_ID_ENV, RANK_ENV, WORLD_ENV, new_unique_id

    cmd = [sys.executable, __file__, "--worker", "--shape", args.shape, "--batch", str(args.batch)]
    envs = [dict(os.environ)]
    if n > 1:
        uid = new_unique_id()
        envs = [{**os.environ, RANK_ENV: str(r), WORLD_ENV: str(n), LOCAL_ENV: str(r), NCCL_ID_ENV: uid}
                for r in range(n)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for env in envs]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{n} GPU(s): a rank failed (exit codes {[p.returncode for p in procs]})")
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("{"))
    print(line, flush=True)
    return json.loads(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the data-parallel run (default 2)")
    parser.add_argument("--shape", default="120M", choices=("12M", "120M"))
    parser.add_argument("--batch", type=int, default=8, help="sequences per GPU (default 8)")
    parser.add_argument("--json", help="write the runs and the efficiency here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    one = run(args, 1)
    many = run(args, args.gpus)
    efficiency = many["tokens_per_s"] / (args.gpus * one["tokens_per_s"])
    print(f"{args.shape}, B={args.batch} a GPU: 1 GPU {one['tokens_per_s']:,} tokens/s; {args.gpus} GPUs "
          f"{many['tokens_per_s']:,} tokens/s; scaling efficiency {efficiency:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"one": one, "many": many, "efficiency": efficiency}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
