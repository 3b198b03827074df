"""Argument types the commands share: each refuses a value out of its range at parsing, in one sentence
naming the range."""

from __future__ import annotations

import argparse
import math


def at_least(low: int):
    """An argparse type: a whole number of at least `low`, else one sentence naming the valid range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {low}")
        return value

    return parse


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number of at least 0, else one sentence naming the valid range."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of at least 0")
    return value
