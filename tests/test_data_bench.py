"""scripts/bench_data.py on a small input: every stage runs, is timed and has its peak RSS, and the
synthetic input's planted bad records are counted by the pull, not lost silently."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_data.py"
STAGES = ["pull-hermes3", "prep-megachat", "train-tokenizer", "tokenize"]


@pytest.mark.slow
def test_bench_data_measures_every_stage(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--mb", "5", "--vocab-size", "512", "--threads", "1",
                           "--json", str(out), "--keep", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    run, = json.loads(out.read_text())["runs"]
    assert run["input_mb"] >= 5 and list(run["stages"]) == STAGES
    for name, stage in run["stages"].items():
        assert stage["wall_s"] > 0 and stage["mb_per_s"] > 0, name
        assert 50 < stage["peak_rss_mb"] <= stage["peak_tree_rss_mb"] * 1.5 + 50, name
    # one mixed-type value every 1,000 rows and one cut line every 1,500 (a cut line's value is not counted twice)
    mixed = run["rows"] // 1000 - run["rows"] // 3000
    assert run["rows"] >= 1500 and run["pull_dropped"] == {"broken_json": run["rows"] // 1500, "content_not_text": mixed}
    for line in proc.stdout.splitlines()[1:]:
        assert line.split()[0] in STAGES and "MB/s" in line
