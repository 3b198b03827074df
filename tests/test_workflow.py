"""The Snakemake workflow through the real `snakemake` CLI, on ANDREA-tiny from the embedded corpus
(one source per domain, as the default config lists them).

Each test works in a temporary copy of the workflow, its config and the sources it hashes, so the
repository's own results/ and .snakemake/ are never touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from andrea.engines import cuda_available

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SNAKEMAKE = BIN / "snakemake"
COPIED = ("Snakefile", "workflow", "config", "profiles", "andrea", "kernels")
DATA_STAGES = {"pull_hermes3", "prep_megachat", "data_identity", "train_tokenizer", "tokenize"}
SOURCES = [s["name"] for s in yaml.safe_load((REPO / "config" / "config.yaml").read_text())["data"]["sources"]]
REPORT_RULES = {"plot_loss", "eval_table", "all"}

pytestmark = pytest.mark.slow


def copy_workflow(dest: Path, experiments=("ANDREA-tiny",)) -> Path:
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    edit_config(dest, experiments=list(experiments))
    return dest


def edit_config(workdir: Path, **changes) -> None:
    path = workdir / "config" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [str(SNAKEMAKE), "--cores", "2", *args],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=900,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def job_counts(output: str) -> Counter:
    """Jobs by rule from Snakemake's 'Job stats' table; empty when nothing is to be done."""
    if "Nothing to be done" in output:
        return Counter()
    table = output.split("Job stats:", 1)[1]
    counts = Counter()
    for line in table.splitlines()[3:]:
        fields = line.split()
        if not fields or fields[0] == "total":
            break
        counts[fields[0]] = int(fields[1])
    return counts


def planned(workdir: Path, *args: str) -> set[str]:
    return set(planned_counts(workdir, *args))


def planned_counts(workdir: Path, *args: str) -> Counter:
    proc = snakemake(workdir, "--dry-run", *args)
    return job_counts(proc.stdout + proc.stderr)


def set_data(workdir: Path, data: dict) -> None:
    path = workdir / "config" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["data"] = data
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def token_folder(workdir: Path, experiment: str = "ANDREA-tiny") -> str:
    """The token folder `experiment` trains on under the workdir's config (the train job's --data in
    a dry run)."""
    proc = snakemake(workdir, "--dry-run", "--printshellcmds", "--forcerun", "train", f"results/{experiment}.ckpt")
    return re.search(r"andrea train .*--data (\S+)", proc.stdout).group(1)


def one(paths) -> Path:
    """The one path of a glob."""
    found = list(paths)
    assert len(found) == 1, found
    return found[0]


def file_hashes(folder: Path) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A workflow copy where `snakemake` (rule all) has run once for ANDREA-tiny."""
    workdir = copy_workflow(tmp_path_factory.mktemp("workflow"))
    proc = snakemake(workdir)
    ran = job_counts(proc.stdout + proc.stderr)
    assert set(ran) == DATA_STAGES | {"train", "eval"} | REPORT_RULES
    assert len(SOURCES) >= 2 and ran["pull_hermes3"] == ran["prep_megachat"] == len(SOURCES)
    assert ran["data_identity"] == ran["train_tokenizer"] == ran["tokenize"] == 1
    return workdir


def test_end_to_end_on_tiny(built):
    results = built / "results"
    tokens = one((results / "data").glob("tokens-V512-*"))
    assert re.fullmatch(r"tokens-V512-[0-9a-f]{12}", tokens.name)
    assert f"results/data/{tokens.name}" == token_folder(built)
    for name in ("ANDREA-tiny.ckpt", "ANDREA-tiny.loss.json", "ANDREA-tiny.state.json",
                 "eval/ANDREA-tiny.json", "report/ANDREA-tiny.loss.svg", "report/evaluation.html",
                 f"data/{tokens.name}/train.bin.manifest.json", f"data/{tokens.name}/tokenizer.json"):
        assert (results / name).is_file(), name
    identity = json.loads((tokens / "identity.json").read_text())
    assert [s["name"] for s in identity["sources"]] == SOURCES and identity["vocab_size"] == 512
    preps = []
    for source in SOURCES:
        folder = one((results / "data" / "sources").glob(f"{source}-*"))
        prep = one(folder.glob("megachat-*"))
        preps.append(f"../sources/{folder.name}/{prep.name}/train.parquet")
        for path in (folder / "hermes3.parquet", prep / "val.parquet.manifest.json",
                     tokens / source / "train.bin", tokens / source / "val.mask.bin.manifest.json"):
            assert path.is_file(), path
    tokenizer_inputs = json.loads((tokens / "tokenizer.json.manifest.json").read_text())["inputs"]
    assert [i["path"] for i in tokenizer_inputs] == preps
    lineage = subprocess.run([str(BIN / "andrea"), "lineage", f"results/data/{tokens.name}/{SOURCES[-1]}/train.bin"],
                             cwd=built, capture_output=True, text=True)
    assert lineage.returncode == 0 and f"{SOURCES[-1]}.jsonl.gz" in lineage.stdout, lineage.stdout
    train_log = (results / "logs/train/ANDREA-tiny.log").read_text()
    assert len(re.findall(r"engine: numpy", train_log)) == 1, "the NumPy engine is named once"
    assert "ANDREA-tiny" in (results / "report/evaluation.html").read_text()
    assert "<polyline" in (results / "report/ANDREA-tiny.loss.svg").read_text()


def test_unchanged_rerun_plans_nothing(built):
    assert planned(built) == set()
    summary = snakemake(built, "--summary").stdout
    plans = {line.split("\t")[-1] for line in summary.splitlines()[1:] if "\t" in line}
    assert plans == {"no update"}, summary


def test_tokenizer_parameter_reruns_tokenizer_and_downstream_only(built):
    edit_config(built, tokenizer={"min_frequency": 3})
    tokens = {"data_identity", "train_tokenizer", "tokenize"}  # in a new token folder
    try:
        assert planned(built, "results/eval/ANDREA-tiny.json") == tokens | {"train", "eval"}
        assert planned(built) == tokens | {"train", "eval"} | REPORT_RULES
    finally:
        edit_config(built, tokenizer={"min_frequency": 2})
    assert planned(built) == set()


def test_code_change_reruns_what_runs_it(built):
    kernel = built / "kernels" / "common.cuh"
    prep = built / "andrea" / "data" / "prep_megachat.py"
    for path, expected in ((kernel, {"train", "eval"}),
                           (prep, {"prep_megachat", "train_tokenizer", "tokenize", "train", "eval"})):
        original = path.read_text()
        path.write_text(original + "\n// changed\n" if path.suffix == ".cuh" else original + "\n# changed\n")
        try:
            assert planned(built) == expected | REPORT_RULES
        finally:
            path.write_text(original)
    assert planned(built) == set(), "restored sources (new mtimes, same text) rerun nothing"


def test_forcerun_prep_megachat(built):
    proc = snakemake(built, "--forcerun", "prep_megachat")
    ran = job_counts(proc.stdout + proc.stderr)
    assert set(ran) == DATA_STAGES - {"pull_hermes3", "data_identity"} | {"train", "eval"} | REPORT_RULES
    assert ran["prep_megachat"] == len(SOURCES)
    assert planned(built) == set()


def test_forcerun_of_one_sources_prep_reruns_that_sources_chain_only(built):
    prep = one((built / "results/data/sources").glob(f"{SOURCES[0]}-*/megachat-*/train.parquet"))
    counts = planned_counts(built, "--forcerun", str(prep.relative_to(built)))
    assert counts["prep_megachat"] == 1 and "pull_hermes3" not in counts
    # the tokenizer is trained on every source, so it and what follows it rerun
    assert set(counts) == DATA_STAGES - {"pull_hermes3", "data_identity"} | {"train", "eval"} | REPORT_RULES


def test_other_sources_make_other_folders_and_leave_the_old_ones(built):
    """Dropping a source builds the same experiment's tokens in a new folder; every data file the first
    config made (its token folder, every source's pull and prep) keeps its bytes."""
    old = token_folder(built)
    before = file_hashes(built / "results" / "data")
    config = (built / "config" / "config.yaml").read_text()
    edit_config(built, data={"sources": [s for s in yaml.safe_load(config)["data"]["sources"] if s["name"] == SOURCES[0]]})
    try:
        new = token_folder(built)
        assert new != old and new.startswith("results/data/tokens-V512-")
        proc = snakemake(built, f"{new}/train.bin")
        # the kept source's pull and prep are the old ones, by name
        assert set(job_counts(proc.stdout + proc.stderr)) == {"data_identity", "train_tokenizer", "tokenize"}
        after = file_hashes(built / "results" / "data")
        assert {p: after.get(p) for p in before} == before
        assert [s["name"] for s in json.loads((built / new / "identity.json").read_text())["sources"]] == SOURCES[:1]
    finally:
        (built / "config" / "config.yaml").write_text(config)
    assert token_folder(built) == old and planned(built) == set()


def test_report_has_loss_curve_and_eval_table(built):
    snakemake(built, "--report", "report.html")
    html = (built / "report.html").read_text()
    assert "ANDREA-tiny.loss.svg" in html and "evaluation.html" in html
    assert all(f"{s}</tt>" in html for s in SOURCES), "the description names each source"


def test_dry_run_of_12m_lists_all_stages(tmp_path):
    workdir = copy_workflow(tmp_path)
    proc = snakemake(workdir, "--dry-run", "--printshellcmds", "results/ANDREA-12M.ckpt")
    counts = job_counts(proc.stdout)
    assert set(counts) == DATA_STAGES | {"train"}
    assert counts["pull_hermes3"] == counts["prep_megachat"] == len(SOURCES)
    assert "--vocab-size 4096" in proc.stdout
    assert re.search(r"--data results/data/tokens-V4096-[0-9a-f]{12} ", proc.stdout)
    for source in SOURCES:
        assert re.search(rf"--source {source}=results/data/sources/{source}-[0-9a-f]{{12}}/megachat-[0-9a-f]{{12}} ",
                         proc.stdout)


def test_the_single_source_form_still_works(tmp_path):
    workdir = copy_workflow(tmp_path)
    set_data(workdir, {"source": "embedded:pydocs", "val_fraction": 0.05})
    proc = snakemake(workdir, "--dry-run", "--printshellcmds", "results/ANDREA-tiny.ckpt")
    counts = job_counts(proc.stdout)
    assert counts["pull_hermes3"] == counts["prep_megachat"] == 1
    assert re.search(r"--source embedded:pydocs --out results/data/sources/pydocs-[0-9a-f]{12}/hermes3.parquet",
                     proc.stdout)


def test_bad_config_and_unknown_experiment_fail_clearly(tmp_path):
    workdir = copy_workflow(tmp_path)
    proc = snakemake(workdir, "--dry-run", "results/ANDREA-nope.ckpt", check=False)
    assert proc.returncode != 0
    assert "config/experiments/ANDREA-nope-TRAIN.json: no such experiment file" in proc.stdout + proc.stderr
    edit_config(workdir, data={"val_fraction": 1.5})
    proc = snakemake(workdir, "--dry-run", check=False)
    assert proc.returncode != 0
    assert "Failed validating 'exclusiveMaximum'" in proc.stdout + proc.stderr
    assert "['val_fraction']" in proc.stdout + proc.stderr
    for data, says in (({"source": "embedded", "sources": [{"name": "a", "source": "embedded"}]},
                        "data has both `sources` and `source`"),
                       ({"sources": [{"name": "a", "source": "embedded"}, {"name": "a", "source": "hub"}]},
                        "two sources named 'a'"),
                       ({"sources": [{"name": "../up", "source": "embedded"}]}, "does not match")):
        set_data(workdir, data)
        proc = snakemake(workdir, "--dry-run", check=False)
        assert proc.returncode != 0 and says in proc.stdout + proc.stderr, (says, proc.stdout + proc.stderr)


def test_lint_leaves_only_the_documented_warning(tmp_path):
    workdir = copy_workflow(tmp_path)
    proc = snakemake(workdir, "--lint", check=False)
    lints = {line.strip() for line in proc.stderr.splitlines() if line.startswith("    * ")}
    # The one accepted lint: rules run the venv's `andrea`, not a per-rule conda env (docs/WORKFLOW.md).
    assert lints <= {"* Specify a conda environment or container for each rule.:"}, proc.stderr


def test_snakefmt_formatted():
    snakefmt = BIN / "snakefmt"
    if not snakefmt.exists():
        pytest.skip("snakefmt is not installed (pip install snakefmt; scripts/setup.sh --test installs it)")
    proc = subprocess.run([str(snakefmt), "--check", "--diff", "Snakefile", "workflow/"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_train_rule_asks_for_data_parallel_with_several_gpus(tmp_path):
    workdir = copy_workflow(tmp_path)
    one = snakemake(workdir, "results/ANDREA-tiny.ckpt", "--dry-run", "--printshellcmds")
    assert "andrea train " in one.stdout and "--gpus" not in one.stdout
    four = snakemake(workdir, "results/ANDREA-tiny.ckpt", "--dry-run", "--printshellcmds",
                     "--resources", "gpu=4", "--set-resources", "train:gpu=4")
    assert "--gpus 4" in four.stdout


# ---- overrides and the run folder --------------------------------------------------------------

PHASED = "ANDREA-tinyphases"


def write_phased(workdir: Path, steps: int = 20, cooldown: bool = False, precision: str = "fp32") -> dict:
    """ANDREA-tiny as phases: `main` at a constant rate (a longer one extends a run), optionally a
    `cool` phase after it."""
    raw = json.loads((workdir / "config/experiments/ANDREA-tiny-TRAIN.json").read_text())
    del raw["train"], raw["schedule"]
    raw["name"] = PHASED
    raw["precision"] = precision
    raw["phases"] = [{"name": "main", "length": {"steps": steps}, "lr": {"warmup_steps": 5, "decay": "constant"}}]
    if cooldown:
        raw["phases"].append({"name": "cool", "length": {"steps": 10}, "lr": {"decay": "linear", "final_ratio": 0.1}})
    (workdir / f"config/experiments/{PHASED}-TRAIN.json").write_text(json.dumps(raw))
    return raw


def planned_train(workdir: Path, *args: str) -> tuple[str, str]:
    """The run folder and the whole `andrea train` command a dry run plans for PHASED."""
    proc = snakemake(workdir, "--dry-run", "--printshellcmds", f"results/{PHASED}.ckpt", *args)  # --config takes the rest
    command = re.search(r"andrea train .*", proc.stdout).group(0)
    return re.search(r"--out (results/runs/\S+)/", command).group(1), command


def fake_run(workdir: Path, folder: str, raw: dict, step: int) -> None:
    """A run folder whose state says it ran `raw` to `step` (what the planning reads of a run)."""
    (workdir / folder).mkdir(parents=True, exist_ok=True)
    (workdir / folder / f"{PHASED}.state.json").write_text(
        json.dumps({"experiment": raw, "step": step, "train_tokens": 1_000_000}))


def test_run_folder_follows_the_trajectory(built):
    """A run is reused when it can continue as the edited or overridden experiment (a longer constant
    phase, a new phase), else a new folder is named by the experiment's hash; the same files plan the
    same folder."""
    try:
        raw = write_phased(built)
        first, command = planned_train(built)
        assert re.fullmatch(rf"results/runs/{PHASED}/[0-9a-f]{{12}}-[0-9a-f]{{12}}", first)
        cpu_max_steps = yaml.safe_load((built / "config" / "config.yaml").read_text())["train"]["cpu_max_steps"]
        assert "--set" not in command and f"--cpu-max-steps {cpu_max_steps} " in command
        assert planned_train(built)[0] == first, "the same config and files, the same folder"
        family = first.rsplit("/", 1)[1].split("-")[0]
        fake_run(built, first, raw, 20)
        write_phased(built, cooldown=True)  # a new phase after the finished one: extended
        assert planned_train(built)[0] == first
        write_phased(built)
        longer = ["--config", f'overrides={{"{PHASED}": ["phases.main.length.steps=30"]}}']
        folder, command = planned_train(built, *longer)  # the constant last phase made longer
        assert folder == first and "--set phases.main.length.steps=30 " in command
        # steps already run would change: a new folder of the same family (same trajectory_hash)
        other, command = planned_train(built, "--config", f'overrides={{"{PHASED}": ["phases.main.lr.warmup_steps=3"]}}')
        assert other != first and other.rsplit("/", 1)[1].startswith(family + "-")
        # the first folder now holds the 30-step run: the 20-step experiment cannot continue it, and
        # the folder its hash names is taken, so it gets the next name
        fake_run(built, first, {**raw, "phases": [{**raw["phases"][0], "length": {"steps": 30}}]}, 30)
        assert planned_train(built)[0] == f"{first}-2"
        assert planned_train(built, *longer)[0] == first
    finally:
        shutil.rmtree(built / "results" / "runs" / PHASED, ignore_errors=True)
        (built / f"config/experiments/{PHASED}-TRAIN.json").unlink(missing_ok=True)


def test_without_a_gpu_a_16_bit_experiment_trains_in_fp32_as_a_run_of_its_own(built):
    """The NumPy engine runs fp32 only: where it trains (engine numpy, or auto on a machine without a
    device) a bf16 experiment's job gets `--set precision=fp32`, part of its run's identity; a GPU's
    plan (engine cuda) trains the experiment as written, in a folder of its own; fp32 gets nothing."""
    try:
        write_phased(built, precision="bf16")
        cpu, command = planned_train(built, "--config", "engine=numpy")
        assert "--set precision=fp32 " in command
        if not cuda_available():
            assert "--set precision=fp32 " in planned_train(built)[1]
        gpu, command = planned_train(built, "--config", "engine=cuda")
        assert "--set" not in command and gpu.rsplit("/", 1)[1].split("-")[0] != cpu.rsplit("/", 1)[1].split("-")[0]
        write_phased(built)
        assert "--set" not in planned_train(built, "--config", "engine=numpy")[1]
    finally:
        shutil.rmtree(built / "results" / "runs" / PHASED, ignore_errors=True)
        (built / f"config/experiments/{PHASED}-TRAIN.json").unlink(missing_ok=True)


def set_overrides(workdir: Path, overrides: dict) -> None:
    path = workdir / "config" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["overrides"] = overrides  # whole: edit_config merges dicts
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def test_an_override_reruns_training_and_what_follows(built):
    set_overrides(built, {"ANDREA-tiny": ["optimizer.lr=0.002"]})
    try:
        proc = snakemake(built, "-n", "-p")
        assert set(job_counts(proc.stdout)) == {"train", "eval"} | REPORT_RULES
        assert "--set optimizer.lr=0.002 " in re.search(r"andrea train .*", proc.stdout).group(0)
    finally:
        set_overrides(built, {})
    assert planned(built) == set()
    # the same through --config
    proc = snakemake(built, "-n", "-p", "--config", 'overrides={"ANDREA-tiny": ["optimizer.lr=0.002"]}')
    assert "--set optimizer.lr=0.002 " in proc.stdout and set(job_counts(proc.stdout)) == {"train", "eval"} | REPORT_RULES
    # the eval job reads the experiment from the checkpoint's state (the overridden one)
    assert re.search(r"andrea eval --ckpt results/ANDREA-tiny.ckpt ", proc.stdout)


def test_a_bad_override_fails_the_planning_in_one_sentence(tmp_path):
    workdir = copy_workflow(tmp_path)
    for overrides, says in (({"ANDREA-tiny": ["optimizer.nope=1"]}, "--set optimizer.nope=1"),
                            ({"ANDREA-tiny": ["model.n_head=5"]}, "--set model.n_head=5"),
                            ({"ANDREA-nope": ["optimizer.lr=1"]}, "ANDREA-nope-TRAIN.json: no such experiment file")):
        set_overrides(workdir, overrides)
        proc = snakemake(workdir, "--dry-run", check=False)
        output = proc.stdout + proc.stderr
        lines = [line for line in output.splitlines() if says in line]
        assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in output, output
    set_overrides(workdir, {"ANDREA-tiny": "optimizer.lr=1"})  # not a list
    proc = snakemake(workdir, "--dry-run", check=False)
    assert proc.returncode != 0 and "['overrides']" in proc.stdout + proc.stderr
