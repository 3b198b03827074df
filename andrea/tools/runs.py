"""`andrea runs`: the training runs and data folders under a results folder, and pruning what nothing current uses.

A run is a folder results/runs/<EXPERIMENT>/<KEY>/ holding NAME.ckpt and its files (andrea.store.runfiles), or
a results/NAME.ckpt that no run folder's files are linked to (a run trained there by hand). The workflow
hard-links the current run's files into results/, so "results/ links to it" means results/NAME.ckpt or
results/NAME.loss.json is the same file as the run's (the loss history too, because a resume after a crash
replaces the checkpoint but appends to the history).

What --prune removes (docs/WORKFLOW.md, "Listing and pruning runs"):
  - a run folder that results/ does not link to, that no process holds the lock of, and that is older
    than what results/NAME.* is now (superseded); an unlinked run newer than it may still be resumed;
  - a data folder (results/data/tokens-*/, results/data/sources/*/) that no kept run (for a source: no
    kept token folder) references and that is older than a referenced folder of the same kind (the same
    V, the same source name): the newest folders of a kind nobody references yet may be the current
    config's, about to be trained on. While a running run has no state yet (so its data is unknown), no
    data folder is removed.
Imports nothing of the engine; the dashboard uses survey() to tell current runs from superseded ones.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import sys
from pathlib import Path

from andrea.common.errors import AndreaError
from andrea.store.runfiles import BEST_SUFFIX, RunFiles

RUNS_DIR = "runs"
DATA_DIR = "data"
TOKENS_NAME = re.compile(r"tokens-V(\d+)-.+")
# The files a run is named by: NAME.ckpt (not NAME.best.ckpt), NAME.state.json, NAME.loss.json, NAME.lock.
RUN_SUFFIXES = (".state.json", ".loss.json", ".lock", ".ckpt")


def lock_held(path: Path) -> bool:
    """True when a live process holds NAME.lock (andrea train takes it with flock for the whole run). The
    probe takes a shared lock for an instant and drops it; a lock that cannot be probed counts as held."""
    try:
        fd = os.open(path, os.O_RDONLY)  # never created or truncated here
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is missing
        return False


def load_state(path: Path) -> dict | None:
    """A run's .state.json, or None when it is missing or not a JSON object (listed, never trusted)."""
    try:
        state = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return state if isinstance(state, dict) else None


def tree_bytes(path: Path) -> int:
    """Apparent size of a file or folder (symlinks not followed, each file as often as it is reached)."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:  # removed meanwhile
                pass
    return total


def newest_mtime(paths) -> float:
    times = []
    for p in paths:
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            pass
    return max(times, default=0.0)


def run_names(folder: Path) -> list[str]:
    names = set()
    for entry in folder.iterdir():
        name = entry.name
        if name.endswith(BEST_SUFFIX):
            continue
        for suffix in RUN_SUFFIXES:
            if name.endswith(suffix) and not name.startswith("."):
                names.add(name[: -len(suffix)])
    return sorted(names)


def status_of(state: dict | None, running: bool) -> str:
    if running:
        return "running"
    step, total = (state or {}).get("step"), (state or {}).get("total_steps")
    if isinstance(step, int) and isinstance(total, int) and step >= total:
        return "finished"
    if (state or {}).get("unfinished"):
        return "unfinished"
    return "stopped"


def data_dirs_of(state: dict | None) -> list[str]:
    """Folder names of the data a run's state records: `data.dir`, and each earlier one of data_history."""
    entries = [(state or {}).get("data")] + [h.get("data") for h in (state or {}).get("data_history") or []
                                              if isinstance(h, dict)]
    dirs = [e["dir"] for e in entries if isinstance(e, dict) and isinstance(e.get("dir"), str)]
    # By the folder's name: it carries the data's hash, and the path was relative to wherever the run started.
    return sorted({Path(d.rstrip("/")).name for d in dirs if d.strip("/")})


def run_entry(results: Path, folder: Path, name: str, key: str | None, sizes: bool) -> dict:
    files = RunFiles(folder / f"{name}.ckpt")
    state = load_state(files.state)
    running = lock_held(files.lock)
    experiment = (state or {}).get("experiment")
    best = (state or {}).get("best")
    linked = key is None or any(same_file(results / p.name, p) for p in (files.ckpt, files.loss))
    return {
        "experiment": experiment.get("name", name) if isinstance(experiment, dict) else folder.parent.name if key else name,
        "key": key,
        "name": name,
        "folder": str(folder),
        "checkpoint": str(files.ckpt),
        "step": (state or {}).get("step"),
        "total_steps": (state or {}).get("total_steps"),
        "phase": (state or {}).get("phase"),
        "best": {k: best.get(k) for k in ("step", "metric", "value")} if isinstance(best, dict) else None,
        "status": status_of(state, running),
        "unfinished": (state or {}).get("unfinished"),
        "running": running,
        "linked": linked,
        "has_state": state is not None,
        "data": data_dirs_of(state),
        "bytes": (tree_bytes(folder) if key else sum(tree_bytes(p) for p in (
            files.ckpt, files.state, files.loss, files.samples, files.log, files.lock, files.best, files.archive))) if sizes else None,
        "mtime": newest_mtime([files.ckpt, files.state, files.loss]) or newest_mtime([folder]),
        "files": files,
    }


def find_runs(results: Path, sizes: bool = True) -> list[dict]:
    """Every run under results/runs/*/*/, then each results/NAME.ckpt that no run folder is linked to."""
    runs = []
    for exp in sorted((results / RUNS_DIR).iterdir()) if (results / RUNS_DIR).is_dir() else ():
        if not exp.is_dir() or exp.is_symlink():
            continue
        for folder in sorted(exp.iterdir()):
            if folder.is_dir() and not folder.is_symlink():
                runs += [run_entry(results, folder, name, folder.name, sizes) for name in run_names(folder)]
    linked = {r["name"] for r in runs if r["linked"]}
    for ckpt in sorted(results.glob("*.ckpt")):
        name = ckpt.name[: -len(".ckpt")]
        if not ckpt.name.endswith(BEST_SUFFIX) and name not in linked and ckpt.is_file():
            runs.append(run_entry(results, results, name, None, sizes))
    return runs


def find_data(results: Path, sizes: bool = True) -> list[dict]:
    """The token folders (results/data/tokens-*/) and the source folders (results/data/sources/*/)."""
    data = results / DATA_DIR
    found = []
    for folder in sorted(data.glob("tokens-*")):
        if not folder.is_dir():
            continue
        identity = load_state(folder / "identity.json") or {}
        sources = [Path(s["folder"].rstrip("/")).name for s in identity.get("sources") or []
                   if isinstance(s, dict) and isinstance(s.get("folder"), str)]
        match = TOKENS_NAME.fullmatch(folder.name)
        found.append({"kind": "tokens", "path": str(folder), "name": folder.name,
                      "group": f"V{match.group(1)}" if match else folder.name, "sources": sources})
    for folder in sorted((data / "sources").glob("*")):
        if folder.is_dir():
            found.append({"kind": "source", "path": str(folder), "name": folder.name,
                          "group": folder.name.rsplit("-", 1)[0], "sources": []})
    for d in found:
        d["is_symlink"] = Path(d["path"]).is_symlink()
        d["bytes"] = tree_bytes(Path(d["path"])) if sizes else None
        d["mtime"] = newest_mtime([Path(d["path"])])
    return found


def run_label(run: dict) -> str:
    return f"{run['experiment']}/{run['key']}" if run["key"] else run["name"]


def decide(runs: list[dict], data: list[dict], results: Path) -> None:
    """Mark each run and data folder `prune` (True: nothing current references it) with the reason."""
    current = {}  # NAME -> when results/NAME.* last changed
    for name in {r["name"] for r in runs}:
        t = newest_mtime([results / f"{name}{s}" for s in (".ckpt", ".state.json", ".loss.json")])
        if t:
            current[name] = t
    for run in runs:
        if run["key"] is None:
            run["prune"], run["why"] = False, "in results/ itself"
        elif run["linked"]:
            run["prune"], run["why"] = False, "current: results/ links to it"
        elif run["running"]:
            run["prune"], run["why"] = False, "running: its lock is held"
        elif run["name"] not in current:
            run["prune"], run["why"] = False, f"nothing in results/ supersedes it (no results/{run['name']}.ckpt)"
        elif run["mtime"] >= current[run["name"]]:
            run["prune"], run["why"] = False, f"newer than results/{run['name']}.ckpt: it may be resumed"
        else:
            run["prune"], run["why"] = True, f"superseded by results/{run['name']}.ckpt"
    by_folder: dict[str, list] = {}
    for run in runs:
        by_folder.setdefault(run["folder"], []).append(run)
    for run in runs:  # a folder goes whole: with another run in it that is kept, it stays
        keeper = next((r for r in by_folder[run["folder"]] if not r["prune"]), None)
        if run["prune"] and keeper is not None:
            run["prune"], run["why"] = False, f"shares its folder with {keeper['name']}, which is kept"
        run["current"] = not run["prune"]
    kept = [r for r in runs if not r["prune"]]
    blind = [run_label(r) for r in kept if r["running"] and not r["has_state"]]
    tokens = [d for d in data if d["kind"] == "tokens"]
    sources = [d for d in data if d["kind"] == "source"]
    mark_users(tokens, [(run_label(r), r["data"], not r["prune"]) for r in runs])
    prune_kind(tokens, blind, "run")
    mark_users(sources, [(t["name"], t["sources"], not t["prune"]) for t in tokens])
    prune_kind(sources, blind, "token folder")


def mark_users(folders: list[dict], users: list[tuple[str, list[str], bool]]) -> None:
    """Each folder's `used_by` (the users, (label, folder names, kept), that name it) and `referenced` (a kept one
    does)."""
    by_name = {d["name"]: d for d in folders}
    for d in folders:
        d["used_by"], d["referenced"] = [], False
    for label, names, kept in users:
        for name in names:
            if name in by_name:
                by_name[name]["used_by"].append(label)
                by_name[name]["referenced"] |= kept


def prune_kind(folders: list[dict], blind: list[str], user: str) -> None:
    """Prune the unreferenced folders that are older than a referenced one of their group."""
    newest_used = {}
    for d in folders:
        if d["referenced"]:
            newest_used[d["group"]] = max(newest_used.get(d["group"], 0.0), d["mtime"])
    for d in folders:
        if d["referenced"]:
            d["prune"], d["why"] = False, f"a kept {user} uses it"
        elif blind:
            d["prune"], d["why"] = False, f"{blind[0]} is running and has recorded no data yet"
        elif d["is_symlink"]:
            d["prune"], d["why"] = False, "a symbolic link; remove it by hand"
        elif d["group"] not in newest_used:
            d["prune"], d["why"] = False, f"no kept {user} uses any {d['group']} folder yet: it may be the current one"
        elif d["mtime"] >= newest_used[d["group"]]:
            d["prune"], d["why"] = False, f"newer than the {d['group']} folder in use: it may be the current one"
        else:
            d["prune"], d["why"] = True, f"no kept {user} uses it, and it is older than the {d['group']} folder in use"


def survey(results, sizes: bool = True) -> dict:
    """The runs and data folders under `results`, each marked `prune` with the reason (see the module doc)."""
    results = Path(results)
    if not results.is_dir():
        raise AndreaError(f"{results}: no such folder; pass the results folder the workflow writes to")
    runs, data = find_runs(results, sizes), find_data(results, sizes)
    decide(runs, data, results)
    return {"results": str(results), "runs": runs, "data": data}


def freed_bytes(paths: list[Path]) -> int:
    """Bytes removing `paths` frees: a file counts once every link to it is among them (run files are
    hard-linked into results/)."""
    seen: dict[tuple[int, int], list] = {}
    for path in paths:
        for folder, _, files in os.walk(path):
            for name in files:
                try:
                    st = os.lstat(os.path.join(folder, name))
                except OSError:
                    continue
                entry = seen.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink, st.st_size])
                entry[0] += 1
    return sum(size for links, nlink, size in seen.values() if links >= nlink)


def remove_tree(path: Path) -> None:
    """Remove a folder; one that vanished meanwhile (or a file in it) is fine; a failure names the path."""
    def failed(func, name, exc):
        err = exc if isinstance(exc, BaseException) else exc[1]
        if isinstance(err, FileNotFoundError):
            return
        raise AndreaError(f"{name}: could not remove it ({getattr(err, 'strerror', None) or err}); "
                          f"fix its permissions and run `andrea runs --prune --yes` again") from None
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=failed)
    else:
        shutil.rmtree(path, onerror=failed)


def prune(listing: dict) -> list[Path]:
    """Remove what `listing` marks `prune`; each run's lock is probed again just before. Returns what was removed."""
    removed, failures = [], []
    for folder in dict.fromkeys(r["folder"] for r in listing["runs"] if r["prune"]):
        if any(lock_held(r["files"].lock) for r in listing["runs"] if r["folder"] == folder):  # started since the survey
            continue
        failures += attempt(Path(folder), removed)
    for d in listing["data"]:
        if d["prune"]:
            failures += attempt(Path(d["path"]), removed)
    for exp in {Path(r["folder"]).parent for r in listing["runs"] if r["prune"]}:
        try:
            exp.rmdir()  # runs/<EXPERIMENT>/ once its last run is gone
        except OSError:
            pass
    if failures:
        raise AndreaError(failures[0] + (f" ({len(failures) - 1} more failed)" if len(failures) > 1 else ""))
    return removed


def attempt(path: Path, removed: list) -> list[str]:
    try:
        remove_tree(path)
    except AndreaError as err:
        return [str(err)]
    except OSError as err:
        if err.errno == errno.ENOENT:
            return []
        return [f"{path}: could not remove it ({err.strerror or err})"]
    removed.append(path)
    return []


# ---- the command ------------------------------------------------------------------------------

def register(subparsers) -> None:
    p = subparsers.add_parser(
        "runs",
        help="list the training runs and data folders under a results folder; --prune removes superseded ones",
        description="List the runs under RESULTS/runs/<EXPERIMENT>/<KEY>/ (and any RESULTS/NAME.ckpt trained "
        "there by hand): step, phase, best validation value, status (running: a process holds its lock; "
        "finished; unfinished: stopped early on purpose; stopped), size, and whether RESULTS/ links to it; then "
        "the data folders with the runs or token folders that use them. See docs/WORKFLOW.md, "
        "'Listing and pruning runs'.",
    )
    p.add_argument("results", nargs="?", default="results", help="the results folder (default: results)")
    p.add_argument("--json", action="store_true", help="print the listing (and with --prune the plan) as JSON")
    p.add_argument("--prune", action="store_true",
                   help="show the run and data folders nothing current uses, and the bytes their removal frees: "
                   "never a run RESULTS/ links to, a running one, or data a kept run uses; nothing is removed without --yes")
    p.add_argument("--yes", action="store_true", help="with --prune: remove them")
    p.set_defaults(func=main)


def public(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in ("files", "is_symlink", "has_state")}


def main(args) -> int:
    if args.yes and not args.prune:
        raise AndreaError("--yes only confirms --prune; pass --prune --yes to remove, or --prune alone to see what it would")
    listing = survey(args.results)
    doomed = [Path(f) for f in dict.fromkeys(r["folder"] for r in listing["runs"] if r["prune"])] + [Path(d["path"]) for d in listing["data"] if d["prune"]]
    freed = freed_bytes(doomed)
    removed = prune(listing) if args.prune and args.yes else None
    if args.json:
        out = {"results": listing["results"], "runs": [public(r) for r in listing["runs"]],
               "data": [public(d) for d in listing["data"]]}
        if args.prune:
            out["prune"] = {"paths": [str(p) for p in doomed], "bytes": freed, "removed": removed is not None}
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console

    console = Console()
    render(listing, console)
    if args.prune:
        say = lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
        if not doomed:
            say("prune: nothing to remove")
        for path in doomed:
            say(f"{'removed' if removed is not None else 'would remove'} {path}")
        if doomed:
            say(f"{'freed' if removed is not None else 'would free'} {human(freed)} ({freed:,} bytes)"
                + ("" if removed is not None else "; pass --yes to remove them"))
    return 0


def human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def render(listing: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(f"runs in {listing['results']}"), title_justify="left")
    for column in ("experiment", "run", "step", "phase", "best val", "status", "size", "results/", "prune?"):
        table.add_column(column, justify="right" if column in ("step", "size") else "left")
    for r in listing["runs"]:
        step = "-" if r["step"] is None else f"{r['step']:,}" + (f" of {r['total_steps']:,}" if isinstance(r["total_steps"], int) else "")
        b = r["best"]
        best = f"{b.get('metric') or 'val'} {b['value']:.4f} @ {b.get('step')}" if b and isinstance(b.get("value"), (int, float)) else "-"
        status = r["status"] + (f" ({r['unfinished']})" if r["status"] == "unfinished" and isinstance(r["unfinished"], str) else "")
        cells = (str(r["experiment"]), r["key"] or "(results/)", step, str(r["phase"] or "-"), best, status,
                 human(r["bytes"]), "linked" if r["linked"] else "", ("prune: " if r["prune"] else "keep: ") + r["why"])
        table.add_row(*map(escape, cells))
    console.print(table)
    data = Table(title="data folders", title_justify="left")
    for column in ("folder", "size", "used by", "prune?"):
        data.add_column(column, justify="right" if column == "size" else "left")
    for d in listing["data"]:
        rel = os.path.relpath(d["path"], listing["results"])
        cells = (rel, human(d["bytes"]), ", ".join(d["used_by"]) or "-", ("prune: " if d["prune"] else "keep: ") + d["why"])
        data.add_row(*map(escape, cells))
    console.print(data)
