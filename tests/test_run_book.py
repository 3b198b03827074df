"""The run's book on the ranks of a data-parallel run: they share --out, and only the main rank touches a file."""

from __future__ import annotations

import pytest

from andrea.run.run_book import RunBook
from andrea.store.runfiles import RunFiles


def book(tmp_path, is_main: bool, logged: list[str]) -> RunBook:
    return RunBook(RunFiles(tmp_path / "run.ckpt"), exp=None, overrides=[], program=None, data={}, train_tokens=0,
                   tokenizer=None, mixture=None, mix_state=None, best_metric="val_loss", log=logged.append,
                   is_main=is_main)


def leftovers(tmp_path) -> dict[str, str]:
    """What a run that never wrote a checkpoint leaves: a loss history, samples, a best checkpoint no state vouches for."""
    files = {"run.loss.json": '{"event": "start"}\n', "run.samples.json": "[]\n", "run.best.ckpt": "not vouched"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return files


@pytest.mark.parametrize("resume", [False, True])
def test_only_the_main_rank_moves_an_earlier_runs_files_aside(tmp_path, resume):
    files = leftovers(tmp_path)
    other: list[str] = []
    book(tmp_path, is_main=False, logged=other).set_aside(resume)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == files and other == []
    main: list[str] = []
    book(tmp_path, is_main=True, logged=main).set_aside(resume)
    moved = {"run.best.ckpt"} | (set() if resume else {"run.loss.json", "run.samples.json"})
    assert {p.name for p in tmp_path.iterdir()} == (set(files) - moved) | {f"{name}.old" for name in moved}
    assert main


def test_a_rank_other_than_the_main_one_writes_no_state(tmp_path):
    book(tmp_path, is_main=False, logged=[]).write_state(3, 1.0)
    book(tmp_path, is_main=False, logged=[]).event("resume", step=3)
    assert list(tmp_path.iterdir()) == []
