"""The op recorder the benchmark times the real schedule with: it sees every op call of a step and changes
nothing of it; which of the PyTorch peer's runs the benchmark counts; how its variants take turns."""

import numpy as np
import pytest

from andrea.spec.config import load_experiment
from andrea.schedule.crosscheck import OPTIMIZER, synthetic_micro_batches
from andrea.engines.numpy_engine import NumpyEngine
from andrea.schedule.model import Model, init_params
from andrea.ops import CALLS
from andrea.schedule.timing import OpRecorder
from conftest import EXPERIMENTS


def test_the_recorder_sees_each_op_of_a_step_and_changes_no_bit():
    exp = load_experiment(EXPERIMENTS / "ANDREA-tiny-TRAIN.json")
    shape, L = exp.model, exp.model.n_layer
    batches = synthetic_micro_batches(shape, 2, 3, step=0)
    states = []
    for engine in (NumpyEngine(), OpRecorder(NumpyEngine())):
        model = Model(engine, shape, 2)
        model.load_state(init_params(model.layout, 0))
        model.train_step(batches, step=0, lr=1e-3, optimizer=OPTIMIZER)
        states.append(b"".join(a.tobytes() for a in model.host_state()))
    assert states[0] == states[1]
    counts = engine.per_step()
    assert set(counts) <= set(CALLS)
    n_micro = len(batches)
    assert counts["embed_fwd"] == counts["embed_bwd"] == counts["loss_fwd"] == n_micro
    assert counts["attn_fwd"] == counts["attn_bwd"] == counts["mlp_bwd"] == L * n_micro
    assert counts["residual_layernorm_fwd"] == 2 * L * n_micro
    assert counts["adamw_step"] == counts["grad_norm_partial"] == 1
    first_args, _ = engine.first_calls()["attn_qkv_fwd"]
    assert first_args[2].shape == (3, shape.d_model, shape.d_model)  # W_QKV, as the op takes it
    assert np.shares_memory(first_args[0], model.buf["qkv"])


def test_the_peer_counts_its_fastest_process_and_keeps_every_run():
    from andrea.schedule.timing import fastest_peer

    runs = [{"ms_per_step": ms, "tokens_per_s": round(16384 / ms * 1e3), "run": i} for i, ms in enumerate((9.9, 7.8, 8.4))]
    best = fastest_peer(runs)
    assert best["run"] == 1 and best["ms_per_step"] == 7.8 and best["tokens_per_s"] == runs[1]["tokens_per_s"]
    assert best["runs_ms"] == [9.9, 7.8, 8.4]
    assert "runs_ms" not in runs[1]  # the runs themselves are left as they were
    with pytest.raises(ValueError):
        fastest_peer([])


def test_each_variant_reads_against_the_bf16_step_of_its_own_shape_and_call():
    from andrea.schedule.timing import against_bf16

    def entry(tokens_per_s):
        return {"micro_batch": 8, "ms_per_step": round(8192 / tokens_per_s * 1e3, 2), "tokens_per_s": tokens_per_s}

    bench = {"engine": {"120M/bf16": entry(500_000), "120M/fp8": entry(580_000), "120M/bf16-eager": entry(450_000),
                        "12M/fp8": entry(3_000_000)}}
    got = {(shape, variant): ratio for shape, variant, ratio in against_bf16(bench)}
    assert got == {("120M", "fp8"): pytest.approx(1.16), ("120M", "bf16-eager"): pytest.approx(0.9)}  # 12M: no bf16
    assert list(against_bf16({})) == []


def _bench_script():
    """scripts/bench.py as a module (it is a script, not a package member)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
    spec = importlib.util.spec_from_file_location("andrea_bench_script", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_benchmark_table_gives_fp8_its_ratio_to_bf16():
    bench = _bench_script()
    engine = {"120M/bf16": {"micro_batch": 8, "ms_per_step": 14.4, "tokens_per_s": 568_889},
              "120M/fp8": {"micro_batch": 8, "ms_per_step": 12.4, "tokens_per_s": 660_645}}
    bench.report["bench"] = {"engine": engine, "baseline": {}, "host": {}}
    text = bench.table()
    assert "120M  fp8         1.161x ANDREA bf16" in text
    assert "failed sections: none" in text


def test_alternating_timers_take_turns_within_each_round():
    from andrea.schedule.timing import alternating

    calls = []

    def timer(name):
        def run():
            calls.append(name)
            return float(len(calls))
        return run

    times = alternating({"bf16": timer("bf16"), "fp8": timer("fp8")}, rounds=3)
    assert calls == ["bf16", "fp8"] * 3
    assert times == {"bf16": [1.0, 3.0, 5.0], "fp8": [2.0, 4.0, 6.0]}
    with pytest.raises(ValueError):
        alternating({"bf16": timer("bf16")}, rounds=0)


def test_the_benchmark_table_shows_an_engine_variant_s_rounds():
    bench = _bench_script()
    engine = {"120M/bf16": {"micro_batch": 8, "ms_per_step": 14.8, "tokens_per_s": 553_514, "runs_ms": [14.9, 14.8, 14.7]},
              "120M/fp8": {"micro_batch": 8, "ms_per_step": 12.9, "tokens_per_s": 635_039}}
    peer = {"ms_per_step": 20.3, "tokens_per_s": 403_547, "runs_ms": [20.3, 20.6]}
    bench.report["bench"] = {"engine": engine, "baseline": {"120M/bf16-compile": peer}, "host": {}}
    lines = bench.table().splitlines()
    (bf16,) = [ln for ln in lines if "bf16-compile" in ln and " bf16 " in ln]
    assert bf16.endswith("1.37x (the bar)  (fastest of 2 runs: 20.30-20.60 ms)  (median of 3 rounds: 14.70-14.90 ms)")
    (fp8,) = [ln for ln in lines if " fp8 " in ln and "PyTorch" in ln]
    assert fp8.endswith("1.57x (the bar)  (fastest of 2 runs: 20.30-20.60 ms)")  # one reading of fp8: no rounds shown


def _entry(ms, tokens=8192):
    return {"micro_batch": 8, "ms_per_step": ms, "tokens_per_s": round(tokens / ms * 1e3)}


def test_fp8_is_judged_against_the_faster_of_the_two_compiled_peers():
    from andrea.schedule.timing import bar_peer, peer_pairs

    engine = {"120M/bf16": _entry(15.0), "120M/fp8": _entry(13.0), "120M/bf16-mma": _entry(16.0),
              "120M/bf16-eager": _entry(17.0), "120M/fp8-masked": _entry(13.5)}
    baseline = {"120M/bf16-compile": _entry(20.0), "120M/fp8-compile": _entry(33.0), "120M/bf16": _entry(30.0)}
    bench = {"engine": engine, "baseline": baseline}
    assert bar_peer(bench, "120M", "fp8") == "bf16-compile"  # torchao's fp8 ran slower than its bf16 here
    bench["baseline"]["120M/fp8-compile"] = _entry(18.0)
    assert bar_peer(bench, "120M", "fp8") == "fp8-compile"
    assert bar_peer(bench, "120M", "bf16") == "bf16-compile"  # torchao's fp8 is never bf16's bar
    assert bar_peer(bench, "12M", "fp8") is None  # no peer ran at that shape
    pairs = {(variant, peer): counts for _, variant, _, peer, base, counts in peer_pairs(bench) if base}
    assert pairs == {("bf16", "bf16"): False, ("bf16", "bf16-compile"): True,
                     ("fp8", "bf16-compile"): False, ("fp8", "fp8-compile"): True,
                     ("bf16-mma", "bf16"): False, ("bf16-mma", "bf16-compile"): True,  # the consumer path's ratio
                     ("bf16-eager", "bf16"): False}  # a masked step has no peer: PyTorch's trains unmasked


def test_bench_variants_name_their_precision_and_kind():
    bench = _bench_script()
    assert bench.variant_parts("fp8") == ("fp8", False, False, False) and bench.variant_parts("fp8").plain
    assert bench.variant_parts("bf16-mma").mma and not bench.variant_parts("bf16-mma").plain
    assert bench.variant_parts("bf16-eager").eager and bench.variant_parts("fp8-masked").masked
    assert all(bench.variant_parts(v).precision in ("fp32", "tf32", "bf16", "fp16", "fp8") for v in bench.BENCH_VARIANTS)
