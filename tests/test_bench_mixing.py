"""scripts/bench_mixing.py's pure parts on synthetic records and shards: the experiments, the checks of a
run's records, the metrics (mean val, steps to uniform's final, shares) and the noise source. No training."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from andrea.spec.config import validate
from andrea.store.loader import source_shards
from andrea.store.shards import mask_path, mask_writer, read_mask, read_shard, write_shard

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_mixing.py"
SPEC = importlib.util.spec_from_file_location("bench_mixing", SCRIPT)
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)

SOURCES = ["pydocs", "wordnet"]


def records(steps=6, every=2, curve=None, sources=SOURCES, mix=None, drawn=None):
    """A mixing run's step records: eval steps every `every` with val_loss_sources from `curve`
    ({step: {source: loss}}, default falling from 5)."""
    mix = mix or {s: 1 / len(sources) for s in sources}
    drawn = drawn or {s: 4 for s in sources}
    out = []
    for step in range(1, steps + 1):
        rec = {"step": step, "phase": "main", "loss": 5.0 - 0.1 * step, "mix": dict(mix),
               "source_loss": {s: 5.0 for s in sources}, "source_sequences": dict(drawn)}
        if step % every == 0 or step == steps:
            val = (curve or {}).get(step, {s: 5.0 - 0.1 * step for s in sources})
            rec["val_loss"] = sum(val.values()) / len(val)
            rec["val_loss_sources"] = dict(val)
        out.append(rec)
    return out


# ---- experiments ---------------------------------------------------------------------------------
def test_policies_default_and_custom():
    got = bench.parse_policies(bench.DEFAULT_POLICIES)
    assert list(got) == ["uniform", "proportional", "bandit", "bandit-loss"]
    assert got["bandit"] == {"policy": "bandit"}
    assert got["bandit-loss"] == {"policy": "bandit", "reward": "loss"}
    got = bench.parse_policies(['py3={"policy": "fixed", "weights": {"pydocs": 3, "wordnet": 1}}', "bandit"])
    assert list(got) == ["uniform", "py3", "bandit"]  # the reference is added, and run first
    assert got["py3"]["weights"] == {"pydocs": 3, "wordnet": 1}


@pytest.mark.parametrize("items", [["nope"], ["bandit", "bandit"], ["a b={\"policy\": \"uniform\"}"],
                                   ["x={not json"], ['x={"reward": "loss"}']])
def test_policies_refused(items):
    with pytest.raises(bench.BenchError):
        bench.parse_policies(items)


@pytest.mark.parametrize("model", sorted(bench.MODELS))
def test_runs_differ_only_in_name_and_mixing(model):
    base = json.loads((bench.EXPERIMENTS / bench.MODELS[model]).read_text())
    common = bench.bench_experiment(base, 50, bench.base_warmup(base), 10, 3)
    assert not {"train", "schedule"} & common.keys()
    assert common["phases"] == [{"name": "main", "length": {"steps": 50},
                                 "lr": {"warmup_steps": bench.base_warmup(base), "decay": "cosine", "final_ratio": 0.1}}]
    assert common["intervals"] == {"checkpoint": 0, "sample": 0, "eval": 10, "eval_batches": 3}
    assert common["model"] == base["model"] and common["seed"] == base["seed"]
    policies = bench.parse_policies(bench.DEFAULT_POLICIES)
    runs = {label: bench.with_policy(common, label, spec) for label, spec in policies.items()}
    for label, exp in runs.items():
        validate(json.loads(json.dumps(exp)), label)
        assert exp["mixing"] == policies[label] and exp["name"] == f"bench-mixing-{label}"
        assert {k: v for k, v in exp.items() if k not in ("name", "mixing")} == {k: v for k, v in common.items() if k != "name"}
    assert len({e["name"] for e in runs.values()}) == len(runs)


def test_base_warmup():
    assert bench.base_warmup({"schedule": {"warmup_steps": 5, "min_lr_ratio": 0.1}}) == 5
    assert bench.base_warmup({"phases": [{"name": "a", "lr": {"warmup_steps": 10}}, {"name": "b"}]}) == 10


# ---- the records' checks ---------------------------------------------------------------------------
def test_check_records_accepts_a_whole_run():
    bench.check_records(records(), 6, SOURCES, "run")


@pytest.mark.parametrize("spoil, message", [
    (lambda r: r.clear(), "no step records"),
    (lambda r: r.pop(), "not 6"),
    (lambda r: r.pop(2), "not steps 1..6"),
    (lambda r: r[0].pop("mix"), "no 'mix'"),
    (lambda r: r[3].pop("source_sequences"), "no 'source_sequences'"),
    (lambda r: r[1].update(loss=float("nan")), "training loss"),
    (lambda r: r[5].pop("val_loss_sources"), "at the last step"),
    (lambda r: r[1]["val_loss_sources"].pop("wordnet"), "validation losses of pydocs"),
    (lambda r: r[3]["val_loss_sources"].update(noise=4.0), "validation losses of"),
    (lambda r: r[5]["val_loss_sources"].update(pydocs=float("inf")), "non-finite"),
    (lambda r: r[2]["mix"].update(other=0.1), "outside"),
])
def test_check_records_refuses(spoil, message):
    recs = records()
    spoil(recs)
    with pytest.raises(bench.BenchError, match=message):
        bench.check_records(recs, 6, SOURCES, "run")


# ---- metrics -------------------------------------------------------------------------------------
def test_mean_val_leaves_noise_out():
    assert bench.mean_val({"pydocs": 4.0, "wordnet": 2.0, "noise": 100.0}, SOURCES) == 3.0
    recs = records(sources=SOURCES + ["noise"], curve={2: {"pydocs": 4.0, "wordnet": 2.0, "noise": 9.0},
                                                        4: {"pydocs": 3.0, "wordnet": 2.0, "noise": 9.0},
                                                        6: {"pydocs": 2.0, "wordnet": 2.0, "noise": 9.0}})
    assert bench.curve(recs, SOURCES) == [(2, 3.0), (4, 2.5), (6, 2.0)]


def test_steps_to_reach():
    points = [(10, 5.0), (20, 4.0), (30, 4.2), (40, 3.9)]
    assert bench.steps_to_reach(points, 4.0) == 20  # the first step at or below, not the last
    assert bench.steps_to_reach(points, 4.1) == 20
    assert bench.steps_to_reach(points, 3.9) == 40
    assert bench.steps_to_reach(points, 3.8) is None
    assert bench.steps_to_reach([], 3.0) is None


def test_draw_shares_and_final_mix():
    recs = records(steps=4, sources=SOURCES + ["noise"], drawn={"pydocs": 6, "wordnet": 2})
    recs[-1]["source_sequences"] = {"pydocs": 2, "wordnet": 2, "noise": 4}
    recs[-1]["mix"] = {"pydocs": 0.75, "wordnet": 0.25}
    shares = bench.draw_shares(recs, SOURCES + ["noise"])
    assert shares == {"pydocs": 20 / 32, "wordnet": 8 / 32, "noise": 4 / 32}
    assert math.isclose(sum(shares.values()), 1.0)
    assert bench.final_mix(recs, SOURCES + ["noise"]) == {"pydocs": 0.75, "wordnet": 0.25, "noise": 0.0}
    with pytest.raises(bench.BenchError):
        bench.draw_shares([{"step": 1, "source_sequences": {}}], SOURCES)


def test_compare_with_uniform():
    def run(values):
        steps = [10 * (i + 1) for i in range(len(values))]
        curve = {s: {"pydocs": v + 0.5, "wordnet": v - 0.5} for s, v in zip(steps, values)}
        return bench.summarize(records(steps=steps[-1], every=10, curve=curve), SOURCES, SOURCES)

    runs = {"uniform": run([5.0, 4.5, 4.0, 3.9]), "fast": run([4.8, 3.9, 3.5, 3.4]), "slow": run([5.0, 4.8, 4.6, 4.4])}
    got = bench.compare(runs)
    assert got["uniform"]["mean_val"] == pytest.approx(3.9) and got["uniform"]["final_step"] == 40
    assert got["uniform"]["steps_to_reference"] == 40 and got["uniform"]["share_of_reference_steps"] == 1.0
    assert got["fast"]["steps_to_reference"] == 20 and got["fast"]["share_of_reference_steps"] == 0.5
    assert got["slow"]["steps_to_reference"] is None and got["slow"]["share_of_reference_steps"] is None
    assert got["fast"]["val"] == {"pydocs": pytest.approx(3.9), "wordnet": pytest.approx(2.9)}
    assert [p[0] for p in got["slow"]["curve"]] == [10, 20, 30, 40]
    table = bench.markdown_table(got, SOURCES, SOURCES)
    lines = table.splitlines()
    assert len(lines) == 5 and all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| slow | 4.4000 |" in table and "not reached" in table and "| 20 | 50% |" in table


# ---- the noise source ------------------------------------------------------------------------------
def write_source(folder: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for split, n in (("train", 3000), ("val", 500)):
        write_shard(folder / f"{split}.bin", rng.integers(0, 512, n))
        with mask_writer(mask_path(folder / f"{split}.bin")) as append:
            append(rng.integers(0, 2, n))


def test_noise_tokens_is_a_fixed_permutation():
    tokens = np.arange(1000, dtype=np.uint16) % 97
    a, b = bench.noise_tokens(tokens, 7, 0), bench.noise_tokens(tokens, 7, 0)
    assert np.array_equal(a, b) and not np.array_equal(a, tokens)
    assert np.array_equal(np.sort(a), np.sort(tokens))
    assert not np.array_equal(a, bench.noise_tokens(tokens, 7, 1))


def test_noisy_folder(tmp_path):
    data = tmp_path / "data"
    for k, name in enumerate(SOURCES):
        write_source(data / name, k)
    (data / "tokenizer.json").write_text("{}")
    noisy = tmp_path / "noisy"
    bench.make_noisy_folder(data, SOURCES, noisy, "wordnet")
    assert [name for name, _ in source_shards(noisy / "train.bin")] == ["noise", "pydocs", "wordnet"]
    assert bench.data_sources(noisy) == ["noise", "pydocs", "wordnet"]
    assert (noisy / "pydocs").is_symlink() and (noisy / "pydocs" / "train.bin").samefile(data / "pydocs" / "train.bin")
    assert (noisy / "tokenizer.json").samefile(data / "tokenizer.json")
    assert not (noisy / "train.bin.manifest.json").exists()
    for split in bench.SPLITS:
        source, noise = read_shard(data / "wordnet" / f"{split}.bin"), read_shard(noisy / "noise" / f"{split}.bin")
        assert noise.size == source.size and not np.array_equal(noise, source)
        assert np.array_equal(np.sort(noise), np.sort(source))
        mask = read_mask(mask_path(noisy / "noise" / f"{split}.bin"), noise.size)
        assert np.array_equal(mask, read_mask(mask_path(data / "wordnet" / f"{split}.bin")))
    first = read_shard(noisy / "noise" / "train.bin").copy()
    bench.make_noisy_folder(data, SOURCES, noisy, "wordnet")  # again: the same links and the same noise
    assert np.array_equal(read_shard(noisy / "noise" / "train.bin"), first)
    (noisy / "pydocs").unlink()
    (noisy / "pydocs").mkdir()
    with pytest.raises(bench.BenchError, match="not a link"):
        bench.make_noisy_folder(data, SOURCES, noisy, "wordnet")


def test_data_sources_refuses(tmp_path):
    write_source(tmp_path / "one" / "pydocs", 0)
    with pytest.raises(bench.BenchError, match="at least two"):
        bench.data_sources(tmp_path / "one")
    for name in SOURCES:
        write_source(tmp_path / "two" / name, 1)
    mask_path(tmp_path / "two" / "wordnet" / "val.bin").unlink()
    with pytest.raises(bench.BenchError, match="val.mask.bin: missing"):
        bench.data_sources(tmp_path / "two")


def test_a_failed_run_is_an_error(tmp_path):
    exp = bench.with_policy(bench.bench_experiment(json.loads((bench.EXPERIMENTS / bench.MODELS["tiny"]).read_text()),
                                                   4, 1, 2, 1), "uniform", {"policy": "uniform"})
    with pytest.raises(bench.BenchError, match="policy uniform: .* failed \\(status 2\\)"):
        bench.run_policy("uniform", exp, tmp_path / "no-data", tmp_path / "out", "numpy", 1)
