"""`andrea train`'s options are defined once (andrea.run.train.add_options): the trainer processes that
--supervise and --gpus start get every option that was set, the supervisor's own excepted. The
tests walk the parser's options, so an option added later is covered with no change here."""

from __future__ import annotations

import argparse
import sys

import pytest

from andrea.cli import build_parser
from andrea.store.runfiles import RunFiles
from andrea.run.supervise import START_OPTIONS, attempt_command
from andrea.run.train import SUPERVISOR_ONLY, add_options, child_command

REQUIRED = ["--experiment", "exp.json", "--data", "data", "--out", "out/run.ckpt"]


def train_actions() -> list[argparse.Action]:
    return add_options(argparse.ArgumentParser(add_help=False))


def non_default(action: argparse.Action) -> list[str]:
    """Command-line words that set `action` to a value other than its default."""
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, next(c for c in action.choices if c != action.default)]
    if action.type is not None:  # int, or a range-checked int (andrea.common.options.at_least)
        return [flag, str((action.default or 0) + 7)]
    return [flag, f"set-{action.dest}"]


def parse(words: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["train", *words])


def trainer_options(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in SUPERVISOR_ONLY and k != "func"}


def set_one(action: argparse.Action) -> tuple[list[str], argparse.Namespace]:
    words = non_default(action)
    rest = [w for flag, value in zip(REQUIRED[::2], REQUIRED[1::2]) if flag not in action.option_strings
            for w in (flag, value)]
    return words, parse(rest + words)


OPTIONS = [a for a in train_actions() if a.dest not in SUPERVISOR_ONLY]


def test_the_supervisor_only_options_exist():
    assert set(SUPERVISOR_ONLY) <= {a.dest for a in train_actions()}
    assert set(START_OPTIONS) <= {a.dest for a in OPTIONS}


@pytest.mark.parametrize("action", OPTIONS, ids=lambda a: a.option_strings[-1])
def test_the_supervised_trainer_gets_every_option_set(action, tmp_path):
    words, args = set_one(action)
    args.supervise = True
    command = attempt_command(child_command(args, omit=START_OPTIONS), args, RunFiles(tmp_path / "run.ckpt"), 0)
    assert command[:4] == [sys.executable, "-m", "andrea.cli", "train"]
    at = command.index(words[0])
    assert command[at:at + len(words)] == words
    assert trainer_options(build_parser().parse_args(command[3:])) == trainer_options(args)


@pytest.mark.parametrize("action", OPTIONS, ids=lambda a: a.option_strings[-1])
def test_each_rank_of_the_launcher_gets_every_option_set(action):
    words, args = set_one(action)
    command = child_command(args)
    at = command.index(words[0])
    assert command[at:at + len(words)] == words
    assert trainer_options(build_parser().parse_args(command[3:])) == trainer_options(args)


def test_the_supervisor_s_own_options_stay_with_it():
    args = parse(REQUIRED + ["--supervise", "--max-restarts", "9", "--max-steps", "5"])
    command = child_command(args, omit=START_OPTIONS)
    assert "--supervise" not in command and "--max-restarts" not in command
    assert command[4:] == REQUIRED + ["--max-steps", "5"]


@pytest.mark.parametrize("start, checkpoint_written, first, restart", [
    ([], False, [], ["--resume"]),
    (["--resume"], False, ["--resume"], ["--resume"]),
    (["--init-from", "a.ckpt"], False, ["--init-from", "a.ckpt"], ["--init-from", "a.ckpt"]),
    (["--init-from", "a.ckpt"], True, ["--init-from", "a.ckpt"], ["--resume"]),
])
def test_a_restart_continues_from_the_last_checkpoint(tmp_path, start, checkpoint_written, first, restart):
    args = parse(REQUIRED + start)
    files = RunFiles(tmp_path / "run.ckpt")
    if checkpoint_written:
        files.ckpt.write_bytes(b"")
    command = child_command(args, omit=START_OPTIONS)
    assert attempt_command(command, args, files, 0) == command + first
    assert attempt_command(command, args, files, 1) == command + restart
