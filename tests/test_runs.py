"""`andrea runs`: the listing of runs and data folders, and --prune, on a results tree written by hand."""

import fcntl
import json
import os
from pathlib import Path

import pytest

import andrea.tools.runs as runs_mod
from andrea.cli import main as cli_main
from andrea.common.errors import AndreaError

DAY = 86400.0
T0 = 1_700_000_000.0


def age(path: Path, days: float) -> None:
    os.utime(path, (T0 + days * DAY, T0 + days * DAY))


def write_run(folder: Path, name: str, *, step: int, total: int = 100, data: str | None = None, unfinished=None,
              days: float, ckpt_bytes: int = 1000) -> Path:
    """A run's files as andrea train leaves them (the contents only as much as the listing reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {"experiment": {"name": name}, "step": step, "total_steps": total, "unfinished": unfinished,
             "phase": "main", "best": {"step": step, "metric": "val_loss", "value": 2.5, "sha256": "0" * 64},
             "data": {"dir": data} if data else None}
    (folder / f"{name}.ckpt").write_bytes(b"\0" * ckpt_bytes)
    (folder / f"{name}.state.json").write_text(json.dumps(state))
    (folder / f"{name}.loss.json").write_text(json.dumps({"step": step, "loss": 3.0}) + "\n")
    (folder / f"{name}.log").write_text("training\n")
    (folder / f"{name}.lock").write_text("")
    for suffix in (".ckpt", ".state.json", ".loss.json", ".log", ".lock"):
        age(folder / f"{name}{suffix}", days)
    return folder


def link_into_results(results: Path, folder: Path, name: str) -> None:
    for suffix in (".ckpt", ".state.json", ".loss.json", ".log"):
        target = results / f"{name}{suffix}"
        target.unlink(missing_ok=True)
        os.link(folder / f"{name}{suffix}", target)


def data_folder(results: Path, rel: str, days: float, sources=(), size: int = 100) -> Path:
    folder = results / "data" / rel
    folder.mkdir(parents=True)
    (folder / "train.bin").write_bytes(b"\1" * size)
    if rel.startswith("tokens-"):
        identity = {"vocab_size": 64, "sources": [{"name": s.rsplit("-", 1)[0], "folder": f"results/data/sources/{s}"}
                                                  for s in sources]}
        (folder / "identity.json").write_text(json.dumps(identity))
    age(folder, days)
    return folder


@pytest.fixture
def tree(tmp_path):
    """results/ with every kind of run and data folder; `held` holds one run's lock, as a trainer would."""
    results = tmp_path / "results"
    runs = results / "runs"
    tok = "results/data/tokens-V64-"
    write_run(runs / "EXP" / "old", "EXP", step=100, data=tok + "oldref", days=1)              # superseded
    cur = write_run(runs / "EXP" / "cur", "EXP", step=100, data=tok + "cur", days=5)            # linked
    write_run(runs / "EXP" / "live", "EXP", step=3, data=tok + "live", days=2)                  # running (lock held)
    write_run(runs / "EXP" / "newer", "EXP", step=40, unfinished="max-steps", data=tok + "newer", days=6)  # newer
    write_run(runs / "OTHER" / "k1", "OTHER", step=10, data=tok + "cur", days=1)               # no results/OTHER.ckpt
    link_into_results(results, cur, "EXP")
    # a run whose checkpoint a resume replaced after the link (it crashed): linked through its history
    crashed = write_run(runs / "CRASH" / "k", "CRASH", step=50, days=1)
    link_into_results(results, crashed, "CRASH")
    (crashed / "CRASH.ckpt").unlink()
    (crashed / "CRASH.ckpt").write_bytes(b"\2" * 1000)
    write_run(runs / "CRASH" / "older", "CRASH", step=100, days=0.5)                             # superseded
    # a run trained straight into results/ by hand
    write_run(results, "hand", step=7, data=tok + "cur", days=3)
    (results / "hand.lock").unlink()

    data_folder(results, "sources/pydocs-p0", days=1)                    # older than the one in use: prune
    data_folder(results, "sources/pydocs-p1", days=2)                    # named by tokens-V64-cur
    data_folder(results, "sources/wordnet-w0", days=1)                   # named only by a pruned token folder
    data_folder(results, "sources/wordnet-w1", days=2)
    data_folder(results, "sources/noise-n0", days=1)                     # no noise folder in use: kept
    data_folder(results, "tokens-V64-cur", days=3, sources=["pydocs-p1", "wordnet-w1"])
    data_folder(results, "tokens-V64-old", days=1, sources=["wordnet-w0"])       # unused, older: prune
    data_folder(results, "tokens-V64-oldref", days=1)                             # used by a pruned run only
    data_folder(results, "tokens-V64-live", days=0.1)                            # the running run's: kept
    data_folder(results, "tokens-V64-newer", days=0.2)                           # the newer run's: kept
    data_folder(results, "tokens-V64-next", days=9)                              # unused, newest: kept
    data_folder(results, "tokens-V128-x", days=0.1)                              # no V128 in use: kept

    lock = open(runs / "EXP" / "live" / "EXP.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    yield results
    lock.close()


PRUNED = ["runs/CRASH/older", "runs/EXP/old", "data/tokens-V64-old", "data/tokens-V64-oldref",
          "data/sources/pydocs-p0", "data/sources/wordnet-w0"]


def run_cli(capsys, *args):
    code = cli_main(["runs", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def listing_json(capsys, results, *args):
    code, out, err = run_cli(capsys, results, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def rel(results, paths):
    return sorted(os.path.relpath(p, results) for p in paths)


def test_the_listing_names_every_run_with_its_status(tree, capsys):
    listing = listing_json(capsys, tree)
    by = {(r["experiment"], r["key"]): r for r in listing["runs"]}
    assert set(by) == {("EXP", "old"), ("EXP", "cur"), ("EXP", "live"), ("EXP", "newer"), ("OTHER", "k1"),
                       ("CRASH", "k"), ("CRASH", "older"), ("hand", None)}
    assert by["EXP", "live"]["status"] == "running" and by["EXP", "live"]["running"]
    assert by["EXP", "cur"]["status"] == "finished" and by["EXP", "cur"]["linked"]
    assert by["EXP", "newer"]["status"] == "unfinished" and by["EXP", "newer"]["unfinished"] == "max-steps"
    assert by["OTHER", "k1"]["status"] == "stopped"
    assert by["CRASH", "k"]["linked"] and not by["CRASH", "older"]["linked"]
    assert [r["linked"] for r in listing["runs"] if r["experiment"] == "EXP"].count(True) == 1
    assert by["EXP", "cur"]["best"] == {"step": 100, "metric": "val_loss", "value": 2.5}
    assert by["EXP", "cur"]["phase"] == "main" and (by["EXP", "cur"]["step"], by["EXP", "cur"]["total_steps"]) == (100, 100)
    # apparent bytes of the run's folder: checkpoint, state, history, log, lock
    folder = tree / "runs" / "EXP" / "cur"
    assert by["EXP", "cur"]["bytes"] == sum(p.stat().st_size for p in folder.iterdir())
    data = {d["name"]: d for d in listing["data"]}
    assert data["tokens-V64-cur"]["used_by"] == ["EXP/cur", "OTHER/k1", "hand"]
    assert data["pydocs-p1"]["used_by"] == ["tokens-V64-cur"]
    assert data["tokens-V64-cur"]["bytes"] == (tree / "data/tokens-V64-cur/train.bin").stat().st_size \
        + (tree / "data/tokens-V64-cur/identity.json").stat().st_size


def test_the_table_on_a_terminal(tree, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    code, out, _ = run_cli(capsys, tree)
    assert code == 0
    for text in ("EXP", "cur", "running", "finished", "unfinished (max-steps)", "linked", "tokens-V64-cur", "val_loss 2.5000 @ 100"):
        assert text in out, text


def test_prune_dry_run_lists_exactly_the_superseded_and_removes_nothing(tree, capsys):
    before = sorted(str(p) for p in tree.rglob("*"))
    listing = listing_json(capsys, tree, "--prune")
    assert rel(tree, listing["prune"]["paths"]) == sorted(PRUNED)
    assert listing["prune"]["removed"] is False
    # the checkpoints of the two pruned runs, their small files and the data folders' files; nothing linked from results/
    doomed = [tree / p for p in PRUNED]
    expected = sum(f.stat().st_size for d in doomed for f in d.rglob("*") if f.is_file())
    assert listing["prune"]["bytes"] == expected
    assert sorted(str(p) for p in tree.rglob("*")) == before
    code, out, _ = run_cli(capsys, tree, "--prune")
    assert code == 0 and "would remove" in out and "--yes" in out


def test_prune_yes_removes_exactly_those(tree, capsys):
    before = {p for p in tree.rglob("*")}
    listing = listing_json(capsys, tree, "--prune", "--yes")
    assert listing["prune"]["removed"] is True
    gone = {p for p in before if not p.exists()}
    assert {os.path.relpath(p, tree) for p in gone if p.parent not in gone} == set(PRUNED)
    # never what results/ links to, a running run, a newer one, or data in use
    for kept in ("EXP.ckpt", "runs/EXP/cur/EXP.ckpt", "runs/EXP/live/EXP.ckpt", "runs/EXP/newer/EXP.ckpt",
                 "runs/CRASH/k/CRASH.loss.json", "runs/OTHER/k1/OTHER.ckpt", "hand.ckpt", "data/tokens-V64-cur",
                 "data/tokens-V64-live", "data/tokens-V64-next", "data/tokens-V128-x", "data/sources/pydocs-p1",
                 "data/sources/noise-n0"):
        assert (tree / kept).exists(), kept
    assert os.path.samefile(tree / "EXP.ckpt", tree / "runs/EXP/cur/EXP.ckpt")
    # a second prune finds nothing more
    assert listing_json(capsys, tree, "--prune")["prune"]["paths"] == []


def test_a_running_run_without_state_keeps_all_data(tree, capsys):
    (tree / "runs/EXP/live/EXP.state.json").unlink()
    listing = listing_json(capsys, tree, "--prune")
    assert rel(tree, listing["prune"]["paths"]) == ["runs/CRASH/older", "runs/EXP/old"]
    assert "recorded no data" in {d["name"]: d for d in listing["data"]}["tokens-V64-old"]["why"]


def test_a_run_that_starts_before_removal_is_kept(tree):
    listing = runs_mod.survey(tree)
    lock = open(tree / "runs/EXP/old/EXP.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        removed = runs_mod.prune(listing)
    finally:
        lock.close()
    assert (tree / "runs/EXP/old/EXP.ckpt").exists()
    assert tree / "runs/EXP/old" not in removed


def test_removal_is_robust(tree, monkeypatch):
    listing = runs_mod.survey(tree)
    import shutil
    shutil.rmtree(tree / "runs/EXP/old")  # vanished meanwhile: fine
    real_rmtree = shutil.rmtree

    def refuse(path, **kw):
        if Path(path).name == "tokens-V64-old":
            handler = kw.get("onexc") or kw.get("onerror")
            err = PermissionError(13, "Permission denied")
            handler(os.unlink, str(Path(path) / "train.bin"), err if "onexc" in kw else (PermissionError, err, None))
        return real_rmtree(path, **kw)

    monkeypatch.setattr(runs_mod.shutil, "rmtree", refuse)
    with pytest.raises(AndreaError, match=r"tokens-V64-old/train\.bin: could not remove it \(Permission denied\)"):
        runs_mod.prune(listing)
    assert not (tree / "data/tokens-V64-oldref").exists()  # the others were still removed


def test_yes_without_prune_is_refused(tree, capsys):
    code, _, err = run_cli(capsys, tree, "--yes")
    assert code == 2 and "--prune" in err


def test_a_missing_results_folder(tmp_path, capsys):
    code, _, err = run_cli(capsys, tmp_path / "nowhere")
    assert code == 2 and "nowhere: no such folder" in err


def test_the_lock_probe_leaves_the_lock_file_alone(tmp_path):
    lock = tmp_path / "r.lock"
    assert not runs_mod.lock_held(lock) and not lock.exists()
    lock.write_text("pid")
    assert not runs_mod.lock_held(lock) and lock.read_text() == "pid"
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert runs_mod.lock_held(lock)
    assert not runs_mod.lock_held(lock)
