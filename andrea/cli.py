"""`andrea` command line: one subcommand per pipeline stage.

Each stage module exposes `register(subparsers)`, adding its subcommand with a `func` default.
Heavy imports stay inside the command functions so `andrea --help` is instant. The `andrea` console
script enters at main(): this module imports nothing but the signal recorder before main() installs it
for `andrea train` (argparse and everything else come after).
"""

from __future__ import annotations

import sys

from andrea.run.stop_signals import STOP_SIGNALS

STAGE_MODULES = [
    "andrea.data.cli",
    "andrea.run.train",
    "andrea.tools.evaluate",
    "andrea.tools.sample",
    "andrea.tools.chat",
    "andrea.tools.export",
    "andrea.tools.inspect_ckpt",
    "andrea.dashboard.cli",
    "andrea.tools.runs",
]


def build_parser():
    """The parser of `andrea` and every stage's subcommand."""
    import argparse
    import importlib

    from andrea import __version__

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
        # before any other import: a signal while the trainer starts is then recorded, not fatal. The
        # process's own command line (argv None) keeps them until it exits: one after the run is not fatal either.
        STOP_SIGNALS.install(until_exit=argv is None)
    from andrea.common.errors import AndreaError, error_sentence

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
