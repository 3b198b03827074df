"""Every reader of a run's history (andrea.store.runfiles, the report's loss curve) passes over hostile lines:
nested deeper than the JSON parser goes, longer than any record, or many megabytes without a newline."""

import importlib.util
import json
import time
import tracemalloc
from pathlib import Path

import pytest

from andrea.store.runfiles import iter_records, read_loss_history

SCRIPT = Path(__file__).resolve().parents[1] / "workflow" / "scripts" / "plot_loss.py"
RECORDS = [{"step": 1, "loss": 6.2, "val_loss": 6.1}, {"step": 2, "loss": 6.0}]
# Lines that are no record; each sits between two records. A record longer than 1 MiB is foreign too.
HOSTILE = {
    "deep array": b"[" * 100_000,
    "deep object": b'{"a":' * 100_000,
    "deep object, closed": b'{"step": 9, "a":' * 50_000 + b"1" + b"}" * 50_000,
    "braces": b"{" * 320_000,
    "overlong record": json.dumps({"step": 3, "loss": 1.0, "pad": "x" * (2 << 20)}).encode(),
}


def history(tmp_path, line: bytes) -> Path:
    path = tmp_path / "run.loss.json"
    path.write_bytes(json.dumps(RECORDS[0]).encode() + b"\n" + line + b"\n" + json.dumps(RECORDS[1]).encode() + b"\n")
    return path


@pytest.mark.parametrize("name", HOSTILE)
def test_records_around_a_hostile_line_are_read(tmp_path, name):
    path = history(tmp_path, HOSTILE[name])
    start = time.monotonic()
    assert list(iter_records(path)) == RECORDS
    assert [r["step"] for r in read_loss_history(path)] == [1, 2]
    assert time.monotonic() - start < 2


def test_a_line_without_end_is_read_past_in_pieces(tmp_path):
    """A 48 MiB line is passed over without holding it: memory stays within a few record limits."""
    path = history(tmp_path, b"x" * (48 << 20))
    tracemalloc.start()
    try:
        records = list(iter_records(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert records == RECORDS
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB"


def test_the_report_draws_past_hostile_lines(tmp_path):
    spec = importlib.util.spec_from_file_location("plot_loss", SCRIPT)
    plot_loss = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_loss)
    path = tmp_path / "run.loss.json"
    lines = [json.dumps({"step": s, "loss": 6.0 - s / 10, "val_loss": 6.0 - s / 9}).encode() for s in range(1, 6)]
    lines[3:3] = [HOSTILE["deep array"], HOSTILE["deep object"],
                  json.dumps({"event": "pivot", "step": 3, "from": "main", "to": "polish"}).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    svg = tmp_path / "loss.svg"
    plot_loss.main(path, svg, "run: loss")
    assert "polish" in svg.read_text()
