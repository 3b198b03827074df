"""Mixing policies compared on the multi-domain embedded corpus (the sources of config/config.yaml).

    python scripts/bench_mixing.py [--model tiny|12M] [--steps N] [--eval-every N] [--eval-batches N]
                                   [--warmup N] [--engine numpy|cuda|auto] [--threads N]
                                   [--policies P [P ...]] [--noise] [--noise-source NAME]
                                   [--data DIR] [--out-dir DIR] [--json FILE]

Trains one model per mixing policy (andrea/store/mixing.py, docs/FIREHOSE-BANDIT.md), each with
`python -m andrea.cli train --experiment E --data D --out OUT/<policy>.ckpt --engine ENGINE` in a
subprocess of its own. Every run starts from the same init and seed: the experiment is
config/experiments/ANDREA-<model>-TRAIN.json without its "phases", "train" and "schedule", with
one phase `{"name": "main", "length": {"steps": STEPS}, "lr": {"warmup_steps": W, "decay":
"cosine", "final_ratio": 0.1}}` and intervals checkpoint 0, sample 0, eval EVERY, eval_batches N;
the runs' experiments differ only in "name" and "mixing".

Policies (--policies, default: uniform proportional bandit bandit-loss):
    uniform       {"policy": "uniform"}: each source alike; the reference the others are measured by
                  (run first, added when not named)
    proportional  {"policy": "proportional"}: by each source's train windows
    bandit        {"policy": "bandit"}: EXP3 on the progress reward (the drop of a source's training
                  loss below its running mean)
    bandit-loss   {"policy": "bandit", "reward": "loss"}: EXP3 on the training loss itself, Online
                  Data Mixing's reward
    LABEL=JSON    any other mixing object, e.g. 'fixed-py={"policy": "fixed", "weights": {"pydocs": 3,
                  "wordnet": 1}}' (LABEL: letters, digits, '_' and '-')

Data: --data DIR (default: the workflow's one results/data/tokens-V<vocab_size>-<hash>, named by the
data config, docs/WORKFLOW.md) holds one subfolder per source.

--noise also runs every policy on a second data folder, OUT/data-noise/: links to the real sources'
subfolders and tokenizer.json, plus noise/, a third source whose train and val shards are the
tokens of one real source (--noise-source, default the first) shuffled with a fixed seed (so it
has the unigram statistics of real text and nothing to learn beyond them), its loss masks copied.
The folder has no union manifest, so the loader finds the three sources by their subfolders. Those
runs go to OUT/noise/<policy>.ckpt; their reference is the uniform run on the same folder. The
question they answer: does a policy starve the source that cannot be learned?

Report, per data folder and policy (a markdown table on stdout as soon as a folder's runs are done;
every number also in --json):
    mean val     the mean over the real sources (never noise) of each source's validation loss
                 (val_loss_sources) at the last eval
    val <src>    each source's validation loss at the last eval
    steps        the first eval step whose mean val is <= uniform's final mean val ("not reached" if
                 none), and that as a share of uniform's steps (its last eval step)
    mix <src>    the mixture's probabilities at the last step
    drawn <src>  each source's share of all sequences drawn over the run (for --noise: the noise
                 source's too)
The JSON also holds each run's curve: [eval step, mean val] at every eval.

A run that fails (non-zero exit, no loss history, records without the mixing fields, a non-finite
loss, fewer steps than asked) stops the benchmark with exit status 1 and a message naming the run
and its log (OUT/<policy>.train.log). --out-dir keeps every run's experiment, checkpoint, loss
history and log; by default they go to a temp folder, removed at the end unless a run failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "config" / "experiments"
MODELS = {"tiny": "ANDREA-tiny-TRAIN.json", "12M": "ANDREA-12M-TRAIN.json"}
NAMED_POLICIES = {
    "uniform": {"policy": "uniform"},
    "proportional": {"policy": "proportional"},
    "bandit": {"policy": "bandit"},
    "bandit-loss": {"policy": "bandit", "reward": "loss"},
}
DEFAULT_POLICIES = ["uniform", "proportional", "bandit", "bandit-loss"]
REFERENCE = "uniform"
NOISE = "noise"
NOISE_SEED = 20240520
SPLITS = ("train", "val")
LABEL = re.compile(r"^[A-Za-z0-9_-]+$")


class BenchError(Exception):
    """A check of the benchmark failed; main prints it and exits 1."""


# ---- the experiments ---------------------------------------------------------------------------
def parse_policies(items: list[str]) -> dict[str, dict]:
    """{label: mixing object} for --policies, uniform (the reference) first."""
    policies: dict[str, dict] = {}
    for item in items:
        if "=" in item:
            label, raw = item.split("=", 1)
            try:
                spec = json.loads(raw)
            except json.JSONDecodeError as err:
                raise BenchError(f"--policies {item!r}: not a JSON object ({err.msg})") from None
            if not isinstance(spec, dict) or "policy" not in spec:
                raise BenchError(f"--policies {item!r}: the mixing object needs a 'policy'")
        elif item in NAMED_POLICIES:
            label, spec = item, NAMED_POLICIES[item]
        else:
            raise BenchError(f"--policies: unknown policy {item!r} (named ones: {', '.join(NAMED_POLICIES)}; "
                             "or LABEL=JSON)")
        if not LABEL.match(label):
            raise BenchError(f"--policies: the label {label!r} may hold only letters, digits, '_' and '-'")
        if label in policies:
            raise BenchError(f"--policies: {label!r} named twice")
        policies[label] = dict(spec)
    if REFERENCE not in policies:
        policies[REFERENCE] = dict(NAMED_POLICIES[REFERENCE])
    return {REFERENCE: policies[REFERENCE], **{k: v for k, v in policies.items() if k != REFERENCE}}


def base_warmup(base: dict) -> int:
    """The base experiment's warmup steps: its schedule's, else its first phase's."""
    if "schedule" in base:
        return int(base["schedule"]["warmup_steps"])
    return int(base["phases"][0].get("lr", {}).get("warmup_steps", 0))


def bench_experiment(base: dict, steps: int, warmup: int, eval_every: int, eval_batches: int) -> dict:
    """The experiment every policy shares: the base with one cosine phase of `steps` and the given intervals."""
    exp = {k: v for k, v in base.items() if k not in ("phases", "train", "schedule", "mixing")}
    exp["description"] = f"scripts/bench_mixing.py: {base['name']}, {steps} steps, one policy per run"
    exp["phases"] = [{"name": "main", "length": {"steps": steps},
                      "lr": {"warmup_steps": warmup, "decay": "cosine", "final_ratio": 0.1}}]
    exp["intervals"] = {"checkpoint": 0, "sample": 0, "eval": eval_every, "eval_batches": eval_batches}
    return exp


def with_policy(common: dict, label: str, mixing: dict) -> dict:
    """One run's experiment: the shared one with its own name and mixing."""
    return {**common, "name": f"bench-mixing-{label}", "mixing": dict(mixing)}


# ---- the noisy data folder ---------------------------------------------------------------------
def noise_tokens(tokens: np.ndarray, seed: int, split: int) -> np.ndarray:
    """The tokens in an order fixed by (seed, split): a permutation, so the same unigram counts."""
    rng = np.random.Generator(np.random.PCG64([seed, split]))
    return rng.permutation(np.asarray(tokens))


def make_noise_source(source: Path, noise: Path, seed: int = NOISE_SEED) -> None:
    """noise/<split>.bin: source's tokens shuffled; noise/<split>.mask.bin: source's mask, copied."""
    from andrea.store.shards import mask_path, mask_writer, read_mask, read_shard, write_shard

    noise.mkdir(parents=True, exist_ok=True)
    for k, split in enumerate(SPLITS):
        tokens = read_shard(source / f"{split}.bin")
        write_shard(noise / f"{split}.bin", noise_tokens(tokens, seed, k))
        mask = read_mask(mask_path(source / f"{split}.bin"), tokens.size)
        with mask_writer(mask_path(noise / f"{split}.bin")) as append:
            append(np.asarray(mask))


def make_noisy_folder(data: Path, sources: list[str], folder: Path, noise_from: str) -> None:
    """folder/: links to data's source subfolders and tokenizer.json, and noise/ made from noise_from."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in sources + ["tokenizer.json"]:
        link, target = folder / name, (data / name).resolve()
        if not target.exists():
            continue  # no tokenizer.json: the runs skip their samples (sample interval 0 anyway)
        if link.is_symlink() or link.exists():
            if link.is_symlink() and link.resolve() == target:
                continue
            raise BenchError(f"{link}: exists and is not a link to {target}; remove it or use another --out-dir")
        link.symlink_to(target, target_is_directory=target.is_dir())
    make_noise_source(data / noise_from, folder / NOISE)


# ---- reading a run's records -------------------------------------------------------------------
def check_records(records: list[dict], steps: int, sources: list[str], where: str) -> None:
    """Raise BenchError unless the step records are a whole mixing run over these sources."""
    if not records:
        raise BenchError(f"{where}: no step records")
    if records[-1]["step"] != steps:
        raise BenchError(f"{where}: the last step record is step {records[-1]['step']}, not {steps}")
    if [r["step"] for r in records] != list(range(1, steps + 1)):
        raise BenchError(f"{where}: the step records are not steps 1..{steps} (a skipped step?)")
    for r in records:
        for key in ("mix", "source_sequences", "source_loss"):
            if key not in r:
                raise BenchError(f"{where}: step {r['step']} has no {key!r}: not a mixing run over several sources")
        if not math.isfinite(r["loss"]):
            raise BenchError(f"{where}: step {r['step']}: the training loss is {r['loss']}")
        if set(r["mix"]) - set(sources) or set(r["source_sequences"]) - set(sources):
            raise BenchError(f"{where}: step {r['step']} names sources outside {', '.join(sources)}")
    evals = [r for r in records if "val_loss_sources" in r]
    if not evals or evals[-1]["step"] != steps:
        raise BenchError(f"{where}: no validation losses per source at the last step {steps}")
    for r in evals:
        got = r["val_loss_sources"]
        if sorted(got) != sorted(sources):
            raise BenchError(f"{where}: step {r['step']} has validation losses of {', '.join(sorted(got))}, "
                             f"not of the sources {', '.join(sorted(sources))}")
        if not all(math.isfinite(v) for v in got.values()):
            raise BenchError(f"{where}: step {r['step']}: a non-finite validation loss {got}")


def mean_val(val_sources: dict[str, float], real: list[str]) -> float:
    """The mean of the real sources' validation losses (the noise source left out)."""
    return math.fsum(val_sources[s] for s in real) / len(real)


def curve(records: list[dict], real: list[str]) -> list[tuple[int, float]]:
    """[(step, mean val)] of every eval record, in step order."""
    return [(r["step"], mean_val(r["val_loss_sources"], real)) for r in records if "val_loss_sources" in r]


def steps_to_reach(points: list[tuple[int, float]], target: float) -> int | None:
    """The first eval step whose mean val is <= target; None if none is."""
    return next((step for step, value in points if value <= target), None)


def draw_shares(records: list[dict], sources: list[str]) -> dict[str, float]:
    """Each source's share of all sequences drawn over the run (0 for a source never drawn)."""
    totals = {s: 0 for s in sources}
    for r in records:
        for s, n in r.get("source_sequences", {}).items():
            totals[s] += n
    total = sum(totals.values())
    if total == 0:
        raise BenchError("no sequences drawn in any step record")
    return {s: n / total for s, n in totals.items()}


def final_mix(records: list[dict], sources: list[str]) -> dict[str, float]:
    """The last step's mixture probabilities, 0 for a source it leaves out."""
    mix = records[-1]["mix"]
    return {s: float(mix.get(s, 0.0)) for s in sources}


def summarize(records: list[dict], sources: list[str], real: list[str]) -> dict:
    """A checked run's numbers, before the comparison with the reference."""
    points = curve(records, real)
    last = [r for r in records if "val_loss_sources" in r][-1]
    return {"final_step": last["step"], "mean_val": points[-1][1],
            "val": {s: last["val_loss_sources"][s] for s in sources},
            "mix": final_mix(records, sources), "drawn": draw_shares(records, sources),
            "curve": [[step, value] for step, value in points]}


def compare(runs: dict[str, dict], reference: str = REFERENCE) -> dict[str, dict]:
    """Each run with the steps it needs to reach the reference's final mean val, and their share of the
    reference's steps (its last eval step)."""
    ref = runs[reference]
    target, ref_steps = ref["mean_val"], ref["final_step"]
    out = {}
    for label, run in runs.items():
        reached = steps_to_reach([tuple(p) for p in run["curve"]], target)
        out[label] = {**run, "target_mean_val": target, "steps_to_reference": reached,
                      "share_of_reference_steps": None if reached is None else reached / ref_steps}
    return out


def markdown_table(runs: dict[str, dict], sources: list[str], real: list[str]) -> str:
    """The report of one data folder's runs, one row per policy."""
    head = (["policy", f"mean val ({', '.join(real)})"] + [f"val {s}" for s in sources]
            + [f"steps to {REFERENCE}'s final", f"vs {REFERENCE}"] + [f"mix {s}" for s in sources]
            + [f"drawn {s}" for s in sources])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    for label, run in runs.items():
        reached = run["steps_to_reference"]
        cells = ([label, f"{run['mean_val']:.4f}"] + [f"{run['val'][s]:.4f}" for s in sources]
                 + (["not reached", "-"] if reached is None else [str(reached), f"{run['share_of_reference_steps']:.0%}"])
                 + [f"{run['mix'][s]:.3f}" for s in sources] + [f"{run['drawn'][s]:.1%}" for s in sources])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- running -----------------------------------------------------------------------------------
def train_env(threads: int) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def default_data(vocab: int) -> Path:
    """The workflow's token folder of this vocabulary size (results/data/tokens-V<vocab>-<hash>, named by the data
    config: docs/WORKFLOW.md), when there is exactly one."""
    found = sorted((REPO / "results" / "data").glob(f"tokens-V{vocab}-*/train.bin"))
    if len(found) != 1:
        what = "none" if not found else ", ".join(str(p.parent) for p in found)
        raise BenchError(f"results/data holds {'no' if not found else len(found)} token folder{'s' * (len(found) != 1)} "
                         f"of vocabulary {vocab} ({what}); build it with `snakemake --cores 2 "
                         f"results/ANDREA-12M.ckpt` (the data stages come first), or pass --data")
    return found[0].parent


def data_sources(data: Path) -> list[str]:
    """The source names the loader finds in data (at least two, each with both splits and their masks)."""
    from andrea.store.loader import source_shards
    from andrea.store.shards import mask_path

    found = source_shards(data / "train.bin")
    names = [name for name, _ in found if name is not None]
    if len(names) < 2:
        raise BenchError(f"{data}: {len(names)} source folder(s) with a train.bin; mixing needs at least two")
    for name in names:
        for split in SPLITS:
            for path in (data / name / f"{split}.bin", mask_path(data / name / f"{split}.bin")):
                if not path.is_file():
                    raise BenchError(f"{path}: missing; rerun `andrea tokenize`")
    return names


def clear_run(out: Path, label: str) -> None:
    """Remove a run's files left by an earlier benchmark in the same folder (its loss history is appended to)."""
    for path in out.glob(f"{label}.*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def run_policy(label: str, experiment: dict, data: Path, out: Path, engine: str, threads: int) -> float:
    """Train one policy; its wall time. A non-zero exit is a BenchError naming the log."""
    out.mkdir(parents=True, exist_ok=True)
    clear_run(out, label)
    exp_path = out / f"{label}.experiment.json"
    exp_path.write_text(json.dumps(experiment, indent=2) + "\n")
    log = out / f"{label}.train.log"
    argv = [sys.executable, "-m", "andrea.cli", "train", "--experiment", str(exp_path), "--data", str(data),
            "--out", str(out / f"{label}.ckpt"), "--engine", engine]
    start = time.perf_counter()
    with open(log, "w") as f:
        status = subprocess.run(argv, cwd=REPO, env=train_env(threads), stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if status != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
        raise BenchError(f"policy {label}: `{' '.join(argv)}` failed (status {status}); see {log}:\n{tail}")
    return wall


def bench_folder(key: str, policies: dict[str, dict], common: dict, data: Path, out: Path, sources: list[str],
                 args) -> dict:
    """Every policy on one data folder: checked, summarized and compared with uniform."""
    from andrea.spec.config import validate
    from andrea.common.errors import AndreaError
    from andrea.store.runfiles import read_loss_history

    real = [s for s in sources if s != NOISE]
    runs, walls = {}, {}
    for label, mixing in policies.items():
        experiment = with_policy(common, label, mixing)
        try:
            validate(json.loads(json.dumps(experiment)), f"{label} experiment")
        except AndreaError as err:
            raise BenchError(f"policy {label}: {err}") from None
        print(f"{key}: {label} ...", file=sys.stderr, flush=True)
        walls[label] = run_policy(label, experiment, data, out, args.engine, args.threads)
        loss_json = out / f"{label}.loss.json"
        if not loss_json.is_file():
            raise BenchError(f"policy {label}: {loss_json} not written")
        records = read_loss_history(loss_json)
        check_records(records, args.steps, sources, f"policy {label} ({loss_json})")
        runs[label] = summarize(records, sources, real)
        print(f"  {walls[label]:.0f} s, mean val {runs[label]['mean_val']:.4f}", file=sys.stderr, flush=True)
    compared = compare(runs)
    for label in compared:
        compared[label]["wall_s"] = round(walls[label], 1)
    return {"data": str(data), "sources": sources, "real_sources": real, "reference": REFERENCE, "runs": compared}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", help="base experiment (default tiny)")
    parser.add_argument("--steps", type=int, default=200, help="training steps of every run (default 200)")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between validation losses (default 20)")
    parser.add_argument("--eval-batches", type=int, default=4, help="micro-batches per validation loss (default 4)")
    parser.add_argument("--warmup", type=int, help="warmup steps (default: the base experiment's, below --steps)")
    parser.add_argument("--engine", choices=("numpy", "cuda", "auto"), default="auto")
    parser.add_argument("--threads", type=int, default=1, help="OPENBLAS_NUM_THREADS of each run (default 1)")
    parser.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES, metavar="P",
                        help=f"default: {' '.join(DEFAULT_POLICIES)}")
    parser.add_argument("--noise", action="store_true", help="also run them with a third, shuffled source")
    parser.add_argument("--noise-source", help="the real source whose tokens noise/ shuffles (default: the first)")
    parser.add_argument("--data", type=Path, help="data folder (default: the workflow's results/data/tokens-V<vocab_size>-<hash>)")
    parser.add_argument("--out-dir", type=Path, help="work folder, kept (default: a temp folder, removed after a success)")
    parser.add_argument("--json", type=Path, help="write every number here")
    args = parser.parse_args(argv)
    for name in ("steps", "eval_every", "eval_batches", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def run(args: argparse.Namespace) -> int:
    policies = parse_policies(args.policies)
    base = json.loads((EXPERIMENTS / MODELS[args.model]).read_text())
    vocab = base["model"]["vocab_size"]
    data = (args.data or default_data(vocab)).resolve()
    if not data.is_dir():
        raise BenchError(f"{data}: no such data folder")
    sources = data_sources(data)
    if args.noise and NOISE in sources:
        raise BenchError(f"{data}: a real source is called {NOISE!r}, the name --noise gives its own source")
    noise_from = args.noise_source or sources[0]
    if args.noise and noise_from not in sources:
        raise BenchError(f"--noise-source {noise_from!r}: not a source of {data} ({', '.join(sources)})")
    warmup = min(base_warmup(base), args.steps - 1) if args.warmup is None else args.warmup
    common = bench_experiment(base, args.steps, warmup, args.eval_every, args.eval_batches)
    figures = {"model": args.model, "base_experiment": MODELS[args.model], "steps": args.steps, "warmup": warmup,
               "eval_every": args.eval_every, "eval_batches": args.eval_batches, "engine": args.engine,
               "threads": args.threads, "policies": policies, "experiment": common, "folders": {}}
    if args.noise:
        figures["noise"] = {"from": noise_from, "seed": NOISE_SEED}

    def report(key: str, result: dict, title: str) -> None:
        figures["folders"][key] = result
        print(f"\n### {title}\n\n{markdown_table(result['runs'], result['sources'], result['real_sources'])}\n", flush=True)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2) + "\n")

    out = args.out_dir.resolve() if args.out_dir else Path(tempfile.mkdtemp(prefix="andrea-bench-mixing-"))
    out.mkdir(parents=True, exist_ok=True)
    result = bench_folder("data", policies, common, data, out, sources, args)
    report("data", result, f"ANDREA-{args.model}, {args.steps} steps, sources {', '.join(sources)} ({data})")
    if args.noise:
        noisy = out / "data-noise"
        make_noisy_folder(data, sources, noisy, noise_from)
        if sorted(data_sources(noisy)) != sorted(sources + [NOISE]):
            raise BenchError(f"{noisy}: the loader finds the sources {', '.join(data_sources(noisy))}, "
                             f"not {', '.join(sorted(sources + [NOISE]))}")
        result = bench_folder("noise", policies, common, noisy, out / "noise", sources + [NOISE], args)
        report("noise", result, f"ANDREA-{args.model}, {args.steps} steps, sources {', '.join(sources)} + "
                                f"{NOISE} (shuffled {noise_from}; left out of the mean)")
    if not args.out_dir:
        shutil.rmtree(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from andrea.common.errors import AndreaError

    try:
        return run(args)
    except (BenchError, AndreaError, OSError) as err:
        print(f"bench_mixing: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
