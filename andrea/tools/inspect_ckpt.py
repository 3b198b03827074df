"""`andrea inspect`: what a checkpoint is — step, size, the experiment it belongs to — and per-tensor
statistics of its weights and Adam moments.

Also the one place that answers "which experiment does this checkpoint belong to" for the other
commands that read a checkpoint (eval, sample, export-hf): `--experiment` when given, else the
experiment recorded in the `.state.json` written beside it by `andrea train`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from andrea.store.checkpoint import is_best, map_checkpoint, read_header, read_state, state_path, vouches
from andrea.spec.config import Experiment, load_experiment, validate
from andrea.common.errors import AndreaError
from andrea.common.hashing import sha256_file
from andrea.spec.layout import ParameterLayout

DEFAULT_EXPERIMENTS_DIR = "config/experiments"
VECTORS = ("weights", "m", "v")


def matching_experiments(n_params: int, folder=DEFAULT_EXPERIMENTS_DIR) -> list[Experiment]:
    """Experiments in `folder` whose model has exactly n_params parameters (invalid files are skipped)."""
    found = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            exp = load_experiment(path)
        except AndreaError:
            continue
        if ParameterLayout(exp.model).n_params == n_params:
            found.append(exp)
    return found


def experiment_for(ckpt, explicit=None) -> Experiment:
    """The experiment a checkpoint belongs to, after checking that its shape fits the checkpoint."""
    ckpt = Path(ckpt)
    _, n_params = read_header(ckpt)
    state = read_state(ckpt) or {}
    speaks = state_path(ckpt)
    if explicit:
        exp = load_experiment(explicit)
    elif "experiment" in state:
        exp = validate(state["experiment"], f"{speaks} (field 'experiment')")
    else:
        raise AndreaError(f"{ckpt}: no {speaks.name} beside it names its experiment; pass --experiment")
    expected = ParameterLayout(exp.model).n_params
    if n_params != expected:
        owners = ", ".join(e.path for e in matching_experiments(n_params)) or "no file in " + DEFAULT_EXPERIMENTS_DIR
        raise AndreaError(
            f"{ckpt}: holds {n_params:,} parameters but experiment {exp.name} ({exp.path}) has {expected:,}; "
            f"it is a checkpoint of another model (matching: {owners})"
        )
    refuse_other_model(ckpt, state, exp, "pass the experiment it was trained with")
    return exp


def refuse_other_model(ckpt, state: dict | None, exp: Experiment, remedy: str) -> None:
    """A checkpoint of another model shape can have the same n_params (vocab 448 / seq 128 against
    vocab 512 / seq 64): its .state.json's model must be the experiment's."""
    trained = (state or {}).get("experiment", {}).get("model")
    if trained is not None and trained != exp.raw["model"]:
        raise AndreaError(
            f"{ckpt}: trained with model {json.dumps(trained, sort_keys=True)} (per {state_path(ckpt)}), "
            f"but {exp.path} has model {json.dumps(exp.raw['model'], sort_keys=True)}; {remedy}"
        )


def tensor_stats(flat: np.ndarray) -> dict:
    """mean, std and max |x| of the finite values, and how many are NaN or infinite."""
    x = flat.astype(np.float64)
    finite = x[np.isfinite(x)]
    stats = {"mean": None, "std": None, "max_abs": None, "nonfinite": int(x.size - finite.size)}
    if finite.size:
        stats.update(mean=float(finite.mean()), std=float(finite.std()), max_abs=float(np.abs(finite).max()))
    return stats


def _layout_experiment(ckpt, explicit, state, matches, notes: list[str]) -> Experiment | None:
    """The experiment whose layout names the tensors: --experiment, else the state's, else the
    matching files' when they agree on every tensor shape."""
    if explicit or state is not None:
        try:
            return experiment_for(ckpt, explicit)
        except AndreaError as err:
            if explicit:
                raise
            notes.append(str(err))
    shapes = {tuple(t.shape for t in ParameterLayout(e.model).tensors) for e in matches}
    return matches[0] if len(shapes) == 1 else None


def inspect_checkpoint(ckpt, explicit=None, experiments_dir=DEFAULT_EXPERIMENTS_DIR) -> dict:
    """Everything `andrea inspect` reports, as one JSON-ready dict."""
    ckpt = Path(ckpt)
    step, *vectors = map_checkpoint(ckpt)
    n_params = vectors[0].size
    state = read_state(ckpt)
    matches = matching_experiments(n_params, experiments_dir)
    notes: list[str] = []
    report = {
        "checkpoint": str(ckpt),
        "bytes": ckpt.stat().st_size,
        "sha256": sha256_file(ckpt),
        "step": step,
        "n_params": n_params,
        "state": None,
        "matches": [{"path": e.path, "name": e.name,
                     "same_trajectory": state is not None and e.trajectory_hash() == state.get("trajectory_hash")}
                    for e in matches],
    }
    if state is not None:
        report["state"] = {"path": str(state_path(ckpt)), "experiment": state.get("experiment", {}).get("name"),
                           "overrides": state.get("overrides") or [],
                           "step": state.get("step"), "total_steps": state.get("total_steps"),
                           "unfinished": state.get("unfinished"),
                           "role": "best" if is_best(ckpt, state) else "checkpoint",
                           "vouches_for_this_file": bool(vouches(ckpt, state, report["sha256"]))}
    exp = _layout_experiment(ckpt, explicit, state, matches, notes)
    if exp is None:
        notes.append(f"no experiment fixes the tensor layout of {n_params:,} parameters; "
                     "statistics cover the whole vector (pass --experiment to split it)")
    pieces = [(t.name, list(t.shape), t.offset, t.end) for t in ParameterLayout(exp.model).tensors] if exp \
        else [("all", [n_params], 0, n_params)]
    report["layout_from"] = exp.path if exp else None
    report["notes"] = notes
    report["tensors"] = [
        {"name": name, "shape": shape, **{vec: tensor_stats(flat[start:end]) for vec, flat in zip(VECTORS, vectors)}}
        for name, shape, start, end in pieces
    ]
    report["totals"] = {vec: tensor_stats(flat) for vec, flat in zip(VECTORS, vectors)}
    return report


def render(report: dict, console) -> None:
    from rich.table import Table

    state = report["state"]
    lines = [
        f"checkpoint  {report['checkpoint']}  ({report['bytes']:,} bytes, sha256 {report['sha256'][:16]}…)",
        f"step        {report['step']:,}",
        f"n_params    {report['n_params']:,}",
        "state       " + (f"{state['path']}: {state['experiment']}"
                          + "".join(f" --set {item}" for item in state["overrides"]) + f", step {state['step']}"
                          + (f" of {state['total_steps']:,}" if state["total_steps"] else "")
                          + (f" (unfinished: stopped by --{state['unfinished']}; `andrea train --resume` continues it)"
                             if state["unfinished"] else "") + ", vouches for this file"
                          f"{' as its best checkpoint' if state['role'] == 'best' else ''}: "
                          f"{'yes' if state['vouches_for_this_file'] else 'NO'}" if state else "none beside the checkpoint"),
        "matches     " + ("; ".join(f"{m['path']} ({m['name']}{', same trajectory' if m['same_trajectory'] else ''})"
                                    for m in report["matches"]) or "no experiment file has this many parameters"),
        f"layout      {report['layout_from'] or 'unknown'}",
        *(f"note        {n}" for n in report["notes"]),
    ]
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    titles = {"weights": "weights", "m": "Adam m (first moment)", "v": "Adam v (second moment)"}
    rows = [*report["tensors"], {"name": "all", "shape": [report["n_params"]], **report["totals"]}]
    for vec in VECTORS:
        table = Table(title=titles[vec], title_justify="left")
        for column in ("tensor", "shape", "mean", "std", "max |x|", "non-finite"):
            table.add_column(column, justify="left" if column in ("tensor", "shape") else "right")
        for row in rows:
            stats = row[vec]
            numbers = ["-" if stats[k] is None else f"{stats[k]:.3g}" for k in ("mean", "std", "max_abs")]
            table.add_row(row["name"], "x".join(map(str, row["shape"])), *numbers, f"{stats['nonfinite']:,}",
                          end_section=row is rows[-2])
        console.print(table)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="show a checkpoint's step, size, experiment and weight/m/v statistics",
        description="Read a checkpoint (the seed's format) and report its step, n_params, the experiment files "
        "it matches (by n_params, and by trajectory against the .state.json beside it), and per-tensor "
        "mean, std and max |x| of the weights and of Adam's m and v.",
    )
    p.add_argument("ckpt", help="checkpoint file, e.g. results/ANDREA-12M.ckpt")
    p.add_argument("--experiment", help="experiment JSON that fixes the tensor layout (default: the one in .state.json)")
    p.add_argument("--experiments-dir", default=DEFAULT_EXPERIMENTS_DIR,
                   help=f"folder of experiment files to match against (default: {DEFAULT_EXPERIMENTS_DIR})")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=main)


def main(args) -> int:
    report = inspect_checkpoint(args.ckpt, args.experiment, args.experiments_dir)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from rich.console import Console

        render(report, Console())
    return 0
