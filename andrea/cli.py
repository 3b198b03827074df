"""`andrea` command line: one subcommand per pipeline stage.

Each stage module exposes `register(subparsers)`, adding its subcommand with a `func` default.
Heavy imports stay inside the command functions so `andrea --help` is instant.
"""

from __future__ import annotations

import argparse
import sys

from andrea import __version__
from andrea.errors import AndreaError, error_sentence
from andrea.stop_signals import STOP_SIGNALS

STAGE_MODULES = [
    "andrea.data.cli",
    "andrea.train",
    "andrea.evaluate",
    "andrea.sample",
    "andrea.export",
    "andrea.inspect_ckpt",
    "andrea.dashboard.cli",
]


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="andrea",
        description="ANDREA: raw chat data to a trained GPT checkpoint. "
        "Stages: pull-hermes3 -> prep-megachat -> train-tokenizer -> tokenize -> train -> eval.",
    )
    parser.add_argument("--version", action="version", version=f"andrea {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in STAGE_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["train"]:
        # before the imports below: a SIGTERM while the trainer starts is then recorded, not fatal
        STOP_SIGNALS.install()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (AndreaError, OSError) as err:
        print(f"andrea {args.command}: error: {error_sentence(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"andrea {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
