"""Progress for the data stages: a rich bar on a terminal, a few plain lines in logs.

Logs (Snakemake's `log:` files, CI) get a start line, at most one line per quarter done and an
end line, never bar redraws.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator


def log(stage: str, message: str) -> None:
    print(f"andrea {stage}: {message}", file=sys.stderr, flush=True)


@contextmanager
def progress(stage: str, description: str, total: int | None, unit: str) -> Iterator[Callable[[int], None]]:
    """Yield `advance(n)`, to be called as each piece of the `total` units is done (None: not
    known ahead, as for a streamed file; logs then get the start and end lines only)."""
    start = time.perf_counter()
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        columns = [SpinnerColumn(), TextColumn(f"andrea {stage}: {description}"), BarColumn(),
                   MofNCompleteColumn(), TextColumn(unit), TimeElapsedColumn()]
        with Progress(*columns, console=Console(stderr=True)) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n=1: bar.advance(task, n)
        return

    log(stage, f"{description} ({total:,} {unit})" if total is not None else description)
    done = 0
    quarters_logged = 0

    def advance(n: int = 1) -> None:
        nonlocal done, quarters_logged
        done += n
        if total and done < total and done * 4 // total > quarters_logged:
            quarters_logged = done * 4 // total
            log(stage, f"{description}: {100 * done // total}% ({done:,}/{total:,} {unit})")

    yield advance
    log(stage, f"{description}: done, {done:,} {unit} in {time.perf_counter() - start:.1f} s")
