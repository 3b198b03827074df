"""Counting what a stage drops: counts by reason, and the first few places of each reason, so a
user can open the file at the line that was dropped."""

from __future__ import annotations

from collections import Counter

PLACES_PER_REASON = 5


class Drops:
    def __init__(self):
        self.counts: Counter = Counter()
        self.where: dict[str, list[str]] = {}

    def add(self, reason: str, place: str) -> None:
        self.counts[reason] += 1
        places = self.where.setdefault(reason, [])
        if len(places) < PLACES_PER_REASON:
            places.append(place)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        return ", ".join(f"{reason} {n:,} (first at {self.where[reason][0]})"
                         for reason, n in sorted(self.counts.items())) or "none"
