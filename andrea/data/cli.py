"""Subcommands of the data stages."""


def register(subparsers) -> None:
    pass
