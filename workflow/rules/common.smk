import functools
import hashlib
import os
import re
import shlex
import sys
from pathlib import Path

from andrea.config import load_experiment as load_experiment_file
from andrea.errors import AndreaError
from andrea.hashing import code_hash
from snakemake.utils import min_version, validate

min_version("9.0")


validate(config, "../schemas/config.schema.yaml")

# The checkout this workflow belongs to: its andrea/ and kernels/ are what the jobs run
# (scripts/setup.sh installs the package from it, editable).
REPO = Path(workflow.current_basedir).parents[1]
EXPERIMENT_DIR = Path("config/experiments")

# `.venv/bin/snakemake` must run the `andrea` installed beside it, also without an activated
# venv. The prefix keeps Snakemake's own default (strict bash).
_venv_bin = Path(sys.executable).parent
if (_venv_bin / "andrea").exists():
    shell.prefix(
        f"set -euo pipefail; export PATH={shlex.quote(str(_venv_bin))}:$PATH; "
    )


wildcard_constraints:
    experiment="ANDREA-[A-Za-z0-9._-]+",
    vocab=r"\d+",
    source=r"[A-Za-z0-9_][A-Za-z0-9._-]*",


# ---- experiments ---------------------------------------------------------------------


def experiment_path(name):
    return EXPERIMENT_DIR / f"{name}-TRAIN.json"


@functools.cache
def load_experiment(name):
    """The experiment JSON, checked by the package (andrea.config: its schema and rules)."""
    path = experiment_path(name)
    if not path.is_file():
        known = sorted(
            p.name[: -len("-TRAIN.json")] for p in EXPERIMENT_DIR.glob("*-TRAIN.json")
        )
        raise WorkflowError(
            f"{path}: no such experiment file (experiments: {', '.join(known) or 'none'}); "
            "add it, or fix the name in config/config.yaml or in the target."
        )
    try:
        experiment = load_experiment_file(path).raw
    except AndreaError as err:
        raise WorkflowError(str(err))
    if experiment["name"] != name:
        raise WorkflowError(
            f"{path}: `name` is {experiment['name']!r} but the file is named for {name!r}; "
            "outputs are named after the file, so make them agree."
        )
    return experiment


# Fail on a bad experiment before planning anything.
for _name in config["experiments"]:
    load_experiment(_name)


def experiment_file(wildcards):
    return str(experiment_path(wildcards.experiment))


def tokens_file(filename):
    """Input function: `filename` in the experiment's token folder, one folder per vocabulary
    size (shared by experiments of the same size)."""

    def path(wildcards):
        vocab = load_experiment(wildcards.experiment)["model"]["vocab_size"]
        return f"results/data/tokens-V{vocab}/{filename}"

    return path


# ---- data sources --------------------------------------------------------------------


def _single_source_name(source):
    """The name of the source of the old single-source form: the embedded domain, `embedded`,
    `hub`, or the local file's name without its extensions."""
    if source.startswith("embedded"):
        return source.partition(":")[2] or "embedded"
    if source == "hub":
        return "hub"
    stem = Path(source).name.split(".")[0]
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem).lstrip(".-") or "local"


def _data_sources():
    """Every source by name, in config order: `data.sources`, or the single `data.source` (with
    `data.hub_id` and `data.revision`) as one source."""
    data = config["data"]
    if "sources" in data and "source" in data:
        raise WorkflowError(
            "config/config.yaml: data has both `sources` and `source`; list every source under "
            "`sources` (the single `source` is the old form of a one-source list)."
        )
    if "sources" in data:
        sources = [dict(s) for s in data["sources"]]
    else:
        source = data.get("source", "embedded")
        sources = [{"name": _single_source_name(source), "source": source}]
    by_name = {}
    for entry in sources:
        if entry["name"] in by_name:
            raise WorkflowError(
                f"config/config.yaml: data.sources has two sources named {entry['name']!r}; "
                "each source's outputs live under results/data/sources/<name>/, so give each its own name."
            )
        entry.setdefault("hub_id", data["hub_id"])
        entry.setdefault("revision", data["revision"])
        by_name[entry["name"]] = entry
    return by_name


DATA_SOURCES = _data_sources()
SOURCE_NAMES = list(DATA_SOURCES)


def data_source(name):
    if name not in DATA_SOURCES:
        raise WorkflowError(
            f"no data source named {name!r} in config/config.yaml (sources: {', '.join(SOURCE_NAMES)})"
        )
    return DATA_SOURCES[name]


def pull_inputs(wildcards):
    """A local source file is an input, so editing it reruns that source's pull."""
    source = data_source(wildcards.source)["source"]
    local = source != "hub" and not source.startswith("embedded")
    return {"source": source} if local else {}


def pull_args(wildcards):
    """The pull's flags. Hub settings only count (and rerun the pull) for a Hub source."""
    entry = data_source(wildcards.source)
    args = ["--source", entry["source"]]
    if entry["source"] == "hub":
        args += ["--hub-id", entry["hub_id"], "--revision", entry["revision"]]
    return shlex.join(args)


def tokenize_sources(wildcards, input):
    """tokenize's --source NAME=DIR flags, one per source, from its MegaChat inputs."""
    return shlex.join(
        arg
        for name, train in zip(SOURCE_NAMES, input.train)
        for arg in ("--source", f"{name}={Path(train).parent}")
    )


# ---- threads -------------------------------------------------------------------------


def job_threads(stage):
    """Configured threads, at most this machine's CPUs: more BLAS threads than cores slow
    NumPy down. Snakemake also caps them at --cores and exports them as OMP_NUM_THREADS,
    OPENBLAS_NUM_THREADS and friends."""
    return min(config["threads"][stage], len(os.sched_getaffinity(0)))


# ---- code versions -------------------------------------------------------------------

# What each stage runs. A dotted name is a module, hashed with every andrea module it
# imports (followed statically, also imports inside functions); a path is a file or folder
# hashed as it is: the command-line front ends (not followed: they import every stage) and
# what a stage reads at run time instead of importing.
STAGE_CODE = {
    "pull_hermes3": [
        "andrea.data.pull_hermes3",
        "andrea/cli.py",
        "andrea/data/cli.py",
        "andrea/data/embedded/",
    ],
    "prep_megachat": [
        "andrea.data.prep_megachat",
        "andrea/cli.py",
        "andrea/data/cli.py",
    ],
    "train_tokenizer": [
        "andrea.data.train_tokenizer",
        "andrea/cli.py",
        "andrea/data/cli.py",
    ],
    "tokenize": ["andrea.data.tokenize_shards", "andrea/cli.py", "andrea/data/cli.py"],
    "train": ["andrea.train", "andrea/cli.py", "andrea/schemas/", "kernels/"],
    "eval": ["andrea.evaluate", "andrea/cli.py", "andrea/schemas/", "kernels/"],
}


def run_dir(wildcards, input):
    """Where a training run keeps its checkpoint while it runs: one folder per (code, experiment,
    data). Snakemake deletes a failed job's outputs, so the resumable run lives outside them; a
    retry of the same job finds its folder and resumes, while any change starts a fresh one.
    """
    digest = hashlib.sha256(code_version("train").encode())
    manifest = Path(f"{input.train}.manifest.json")
    for path in (
        Path(input.experiment),
        manifest if manifest.is_file() else Path(input.train),
    ):
        digest.update(
            path.read_bytes()
            if path.suffix == ".json"
            else str(path.stat().st_size).encode()
        )
    digest.update(config["engine"].encode())
    return f"results/runs/{wildcards.experiment}/{digest.hexdigest()[:12]}"


def code_version(stage):
    """sha256 of the source `stage` runs (andrea.hashing.code_hash). As a param it reruns the
    stage when that source changes: by content, so a checkout that leaves the text alone reruns
    nothing."""
    try:
        return code_hash(REPO, STAGE_CODE[stage])[:16]
    except AndreaError as err:
        raise WorkflowError(f"STAGE_CODE in workflow/rules/common.smk: {err}")
