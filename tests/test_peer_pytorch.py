"""bench/peer_pytorch.py, the benchmark's PyTorch peer, is ANDREA's model: the same parameter count as the layout
of each experiment it times, and a training step that runs (on the CPU here) and reports what bench.py reads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
PEER = REPO / "bench" / "peer_pytorch.py"


def peer_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("peer_pytorch", PEER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shape", ["tiny", "12m", "120m", "350m"])
def test_the_peer_has_the_layout_s_parameters(shape):
    from andrea.spec.config import ModelShape
    from andrea.spec.layout import ParameterLayout

    peer = peer_module()
    dims = peer.model_shape(shape)
    with torch.device("meta"):
        model = peer.GPT(**dims)
    assert sum(p.numel() for p in model.parameters()) == ParameterLayout(ModelShape(**dims)).n_params


def test_the_peer_times_a_step_and_reports_it():
    proc = subprocess.run([sys.executable, str(PEER), "tiny", "fp32", "3", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["params"] == 135_808 and report["ms_per_step"] > 0 and report["tokens_per_s"] > 0
    assert 0 < report["loss"] < 7  # about ln(512) = 6.24 at the start


def test_bench_runs_this_peer_at_its_own_micro_batches():
    import importlib.util

    spec = importlib.util.spec_from_file_location("andrea_bench_script", REPO / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    peer = peer_module()
    assert bench.PEER == PEER
    for name, shape in bench.BASELINE_SHAPE.items():
        experiment, micro_batch = peer.SHAPES[shape]
        assert experiment == f"ANDREA-{name}" and micro_batch == bench.BENCH[name]
