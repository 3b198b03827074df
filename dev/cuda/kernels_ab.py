"""A kernel change as A/B: the training step on each kernels folder or tree, in processes of their own, in turn.

    PYTHONPATH=. python3 dev/cuda/kernels_ab.py BASE FOLDER [FOLDER ...] [--shapes 120M,12M]
        [--precisions bf16,fp8] [--rounds 2] [--ops layernorm_residual_bwd,layernorm_bwd] [--same-bits]

BASE and each FOLDER are kernels/ folders (a copy of an earlier commit's: `git archive REV kernels | tar -x -C
DIR`), run by this tree's Python, or whole trees (a folder with andrea/ and kernels/: `git archive REV | tar -x -C
DIR`), each run by its own copy of this script, for a change outside the kernels. For each shape, precision and
round, every folder runs once, in turn, in a fresh process with ANDREA_KERNELS set to its kernels (so each
compiles its own and nothing of one folder's build reaches the next):
the step's ms (scripts/bench.py's per_step_ms, CUDA graphs), each op of --ops timed alone in a CUDA graph on the
step's own buffers (as the benchmark times them), and a sha256 of the weights after those steps. It prints one
line a run and, last, each folder's median against BASE's. With --same-bits (a change meant to move no bit) it
exits 1 where a folder's weights differ from BASE's in the same shape and precision; it exits 1 too when a run fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def child(folder: str, name: str, precision: str, ops: list[str], steps: int) -> dict:
    from bench import BENCH, EXPERIMENTS, op_times, options, per_step_ms

    from andrea.engines.cuda_engine import CudaEngine
    from andrea.schedule.model import Model, init_params
    from andrea.schedule.timing import OpRecorder

    assert os.environ.get("ANDREA_KERNELS") == folder
    engine = CudaEngine(precision=precision)
    recorder = OpRecorder(engine)
    model = Model(recorder, EXPERIMENTS[name].model, BENCH[name], graphs=True, **options(name))
    model.load_state(init_params(model.layout, 0))
    ms = per_step_ms(model, steps=steps, warm=3)
    bits = hashlib.sha256(model.host_state()[0].tobytes()).hexdigest()[:16]
    times = {op: v["ms"] for op, v in op_times(engine, recorder, model, set(ops)).items()} if ops else {}
    if set(ops) - set(times):
        raise SystemExit(f"no op {sorted(set(ops) - set(times))} in a {name} {precision} step")
    return {"ms": round(ms, 4), "ops": times, "bits": bits}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="kernels folders: the base first")
    ap.add_argument("--shapes", default="120M,12M")
    ap.add_argument("--precisions", default="bf16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=23)
    ap.add_argument("--ops", default="", help="ops to time alone, comma-separated (engine method names)")
    ap.add_argument("--same-bits", action="store_true", help="exit 1 where a folder's weights differ from the base's")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ops = [o for o in args.ops.split(",") if o]
    if args.child:
        (folder,) = args.folders
        print(json.dumps(child(folder, args.shapes, args.precisions, ops, args.steps)), flush=True)
        return 0
    folders = [str(Path(f).resolve()) for f in args.folders]
    for f in folders:
        if not (Path(f) / "common.cuh").is_file() and not (Path(f) / "andrea").is_dir():
            ap.error(f"{f}: neither a kernels folder (no common.cuh) nor a tree (no andrea/)")
    runs: dict[tuple, list[dict]] = {}
    failed = []
    for name in args.shapes.split(","):
        for precision in args.precisions.split(","):
            for r in range(args.rounds):
                for i, folder in enumerate(folders):
                    env, script, kernels = dict(os.environ), __file__, folder
                    if (Path(folder) / "andrea").is_dir():  # a tree: its own Python and its own copy of this script
                        script, kernels = f"{folder}/dev/cuda/kernels_ab.py", f"{folder}/kernels"
                        env["PYTHONPATH"] = os.pathsep.join([folder, *[p for p in [env.get("PYTHONPATH")] if p]])
                    env["ANDREA_KERNELS"] = kernels
                    cmd = [sys.executable, script, kernels, "--child", "--shapes", name, "--precisions", precision,
                           "--steps", str(args.steps), "--ops", ",".join(ops)]
                    p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                       cwd=folder if script != __file__ else None)
                    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                    if p.returncode or not lines:
                        failed.append(f"{name} {precision} round {r} folder {i}")
                        print(f"FAIL {failed[-1]} ({folder}):\n{p.stderr[-3000:]}", file=sys.stderr, flush=True)
                        continue
                    res = json.loads(lines[-1])
                    runs.setdefault((name, precision, i), []).append(res)
                    timed = " ".join(f"{op} {t:.4f}" for op, t in res["ops"].items())
                    print(f"{name} {precision} round {r} folder {i}: {res['ms']:.3f} ms  {timed}  weights {res['bits']}",
                          flush=True)
    unequal = []
    print("\nmedians (folder 0 is the base):")
    for name in args.shapes.split(","):
        for precision in args.precisions.split(","):
            base = runs.get((name, precision, 0))
            for i, folder in enumerate(folders):
                got = runs.get((name, precision, i))
                if not got:
                    continue
                ms = statistics.median(g["ms"] for g in got)
                line = f"  {name} {precision} folder {i}: {ms:.3f} ms"
                if base and i:
                    line += f" ({ms - statistics.median(b['ms'] for b in base):+.3f})"
                for op in ops:
                    t = statistics.median(g["ops"][op] for g in got if op in g["ops"])
                    line += f"  {op} {t:.4f}"
                    if base and i:
                        line += f" ({t - statistics.median(b['ops'][op] for b in base if op in b['ops']):+.4f})"
                bits = {g["bits"] for g in got}
                line += f"  weights {' '.join(sorted(bits))}"
                if base and i and bits != {b["bits"] for b in base}:
                    unequal.append(f"{name} {precision} folder {i}")
                    line += " (not the base's)"
                print(line + f"  {folder}")
    for what in failed:
        print(f"FAIL {what}: the run failed", file=sys.stderr)
    if args.same_bits:
        for what in unequal:
            print(f"FAIL {what}: weights differ from the base's", file=sys.stderr)
    return 1 if failed or (args.same_bits and unequal) else 0


if __name__ == "__main__":
    sys.exit(main())
