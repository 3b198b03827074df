import functools
import hashlib
import json
import os
import re
import shlex
import sys
from pathlib import Path

from andrea.spec.config import continuation_refusal
from andrea.spec.config import load_experiment as load_experiment_file
from andrea.engines import cuda_available, engine_name
from andrea.common.errors import AndreaError
from andrea.common.hashing import code_hash, config_hash, sha256_file
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
    pull=r"[0-9a-f]{12}",
    prep=r"[0-9a-f]{12}",
    data=r"[0-9a-f]{12}",


# ---- experiments ---------------------------------------------------------------------


def experiment_path(name):
    return EXPERIMENT_DIR / f"{name}-TRAIN.json"


def experiment_overrides(name):
    """The `--set KEY=VALUE` items `overrides:` in config/config.yaml gives the experiment."""
    return list(config.get("overrides", {}).get(name, []))


# What a machine that trains on the NumPy engine adds to an experiment in a precision that needs
# CUDA: the NumPy engine's one precision. A run of its own (the override is part of its identity
# and its .state.json), never continued by a GPU run of the experiment as written.
CPU_PRECISION = "precision=fp32"


def trains_on_numpy():
    return engine_name(config["engine"]) == "numpy"


@functools.cache
def effective_experiment(name):
    """The experiment the train job runs and the `--set` items that make it: the JSON with the
    config's overrides applied (and CPU_PRECISION where it applies), checked by the package
    (andrea.spec.config: its schema and rules)."""
    path = experiment_path(name)
    if not path.is_file():
        known = sorted(
            p.name[: -len("-TRAIN.json")] for p in EXPERIMENT_DIR.glob("*-TRAIN.json")
        )
        raise WorkflowError(
            f"{path}: no such experiment file (experiments: {', '.join(known) or 'none'}); "
            "add it, or fix the name in config/config.yaml or in the target."
        )
    overrides = experiment_overrides(name)
    try:
        experiment = load_experiment_file(path, overrides)
        if trains_on_numpy() and experiment.precision != "fp32":
            overrides.append(CPU_PRECISION)
            experiment = load_experiment_file(path, overrides)
    except AndreaError as err:
        where = f"config/config.yaml: overrides of {name}: " if overrides else ""
        raise WorkflowError(f"{where}{err}")
    if experiment.raw["name"] != name:
        raise WorkflowError(
            f"{path}: `name` is {experiment.raw['name']!r} but the file is named for {name!r}; "
            "outputs are named after the file, so make them agree."
        )
    return experiment, tuple(overrides)


def load_experiment(name):
    """The effective experiment's JSON."""
    return effective_experiment(name)[0].raw


# Fail on a bad experiment, or a bad override, before planning anything.
for _name in [*config["experiments"], *config.get("overrides", {})]:
    load_experiment(_name)


def experiment_file(wildcards):
    return str(experiment_path(wildcards.experiment))


def tokens_file(filename):
    """Input function: `filename` in the experiment's token folder, the one of its vocabulary size
    and this config's data (shared by experiments of the same size)."""

    def path(wildcards):
        vocab = load_experiment(wildcards.experiment)["model"]["vocab_size"]
        return f"{tokens_dir(vocab)}/{filename}"

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
                "each source's outputs live under results/data/sources/<name>-<hash>/, so give each its own name."
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


# ---- data identity -------------------------------------------------------------------
# Each data folder is named by a short sha256 of what defines its content, so another config
# makes other folders and never rewrites the ones an earlier run trained on (old folders stay
# until removed by hand). The code a stage runs is not part of it: a code change reruns that
# stage in place (its `code` param).

IDENTITY_LENGTH = 12


def short_hash(identity):
    return config_hash(identity)[:IDENTITY_LENGTH]


def is_local(source):
    return source != "hub" and not source.startswith("embedded")


@functools.cache
def _file_sha256(path, size, mtime_ns):
    """A local source's sha256, read once per (path, size, mtime) in this process: its bytes, not
    its size and time, are its identity."""
    return sha256_file(path)


def local_file(entry):
    """{path, sha256} of a local source; a path that is not a readable file fails the planning."""
    try:
        path = Path(entry["source"]).resolve(strict=True)
        st = path.stat()
        # opening it fails for a directory or an unreadable file
        digest = _file_sha256(str(path), st.st_size, st.st_mtime_ns)
    except OSError as err:
        raise WorkflowError(
            f"config/config.yaml: data source {entry['name']!r} cannot be read from "
            f"{entry['source']} ({(err.strerror or str(err)).lower()}); fix its path (a relative "
            f"path starts at {Path.cwd()}) or make it a readable file."
        )
    return {"path": str(path), "sha256": digest}


@functools.cache
def embedded_corpus_hash():
    """sha256 of the packaged corpus (every file of andrea/data/embedded/)."""
    return code_hash(REPO, ["andrea/data/embedded/"])


def source_identity(name):
    """What a source's pull is made of: its spec and what it reads."""
    entry = DATA_SOURCES[name]
    identity = {"name": name, "source": entry["source"]}
    if entry["source"] == "hub":
        # a branch is taken by name: pin a commit as `revision` to tie the pull to one state
        identity.update(hub_id=entry["hub_id"], revision=entry["revision"])
    elif is_local(entry["source"]):
        identity["file"] = local_file(entry)
    else:
        identity["embedded_corpus_sha256"] = embedded_corpus_hash()
    return identity


# Computed while the Snakefile is parsed, so a missing local source fails every run, `-n` too.
SOURCE_IDENTITIES = {name: source_identity(name) for name in SOURCE_NAMES}
# results/data/sources/<name>-<hash>/: the pull; its megachat-<hash>/: the prep, which adds
# val_fraction (so changing it reruns the prep, never the pull)
SOURCE_DIRS = {
    name: f"results/data/sources/{name}-{short_hash(identity)}"
    for name, identity in SOURCE_IDENTITIES.items()
}
PREP_HASH = short_hash({"val_fraction": config["data"]["val_fraction"]})
PREP_DIRS = {
    name: f"{folder}/megachat-{PREP_HASH}" for name, folder in SOURCE_DIRS.items()
}


@functools.cache
def data_identity(vocab):
    """What a token folder is made of: every source (in config order, the tokenizer's input
    order), val_fraction, the tokenizer settings and the vocabulary size. identity.json in the
    folder is this, and its name carries its short hash."""
    return {
        "vocab_size": int(vocab),
        "sources": [
            {**SOURCE_IDENTITIES[name], "folder": SOURCE_DIRS[name]}
            for name in SOURCE_NAMES
        ],
        "val_fraction": config["data"]["val_fraction"],
        "tokenizer": {
            key: config["tokenizer"][key]
            for key in ("min_frequency", "max_token_length", "unspaced_chunk")
        },
    }


def tokens_dir(vocab):
    return f"results/data/tokens-V{vocab}-{short_hash(data_identity(vocab))}"


def check_source_dir(wildcards):
    """Input function of the per-source rules: they build this config's folders only (a folder of
    another hash belongs to another config and is never rewritten); no inputs."""
    asked = f"results/data/sources/{wildcards.source}-{wildcards.pull}"
    expected = SOURCE_DIRS.get(wildcards.source)
    if hasattr(wildcards, "prep"):
        asked = f"{asked}/megachat-{wildcards.prep}"
        expected = f"{expected}/megachat-{PREP_HASH}"
    if asked != expected:
        raise WorkflowError(
            f"{asked}: not a folder of the data in config/config.yaml (its sources are "
            f"{', '.join(SOURCE_DIRS.values())}, prepared in megachat-{PREP_HASH}/); ask for a "
            "target of this config, or restore the config that made it."
        )
    return {}


def check_tokens_dir(wildcards):
    """Input function of the token folder's rules, as check_source_dir for the sources."""
    asked = f"results/data/tokens-V{wildcards.vocab}-{wildcards.data}"
    if asked != tokens_dir(wildcards.vocab):
        raise WorkflowError(
            f"{asked}: not the token folder of config/config.yaml's data (for V{wildcards.vocab} "
            f"that is {tokens_dir(wildcards.vocab)}); ask for a target of this config, or "
            "restore the config that made it."
        )
    return {}


def identity_json(wildcards):
    return json.dumps(data_identity(wildcards.vocab), indent=2, sort_keys=True) + "\n"


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
    "train": ["andrea.run.train", "andrea/cli.py", "andrea/schemas/", "kernels/"],
    "eval": ["andrea.tools.evaluate", "andrea/cli.py", "andrea/schemas/", "kernels/"],
}


def set_flags(wildcards):
    """The train job's `--set` flags (effective_experiment's items)."""
    _, items = effective_experiment(wildcards.experiment)
    return shlex.join(arg for item in items for arg in ("--set", item))


def planned_device(wildcards):
    """`cuda` when this machine has a CUDA device, else `cpu`. A param: the same command on a GPU
    machine reruns a run that stopped at train.cpu_max_steps; an fp32 experiment's run resumes
    there and finishes, one in another precision trains from the start (CPU_PRECISION).
    """
    return "cuda" if cuda_available() else "cpu"


def read_run_state(folder, name):
    """The .state.json of the run in `folder`, or None (none yet, or unreadable)."""
    try:
        state = json.loads((folder / f"{name}.state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def run_dir(wildcards, input):
    """Where a training run keeps its checkpoint while it runs. Snakemake deletes a failed job's
    outputs, so the resumable run lives outside them, in results/runs/{experiment}/FAMILY-HASH/.

    FAMILY is a short hash of what every step depends on: the train code, the data (the token
    folder's name carries the data identity; the train shard's manifest covers code changes that
    rewrite the shards in place), the engine setting and the experiment's trajectory_hash (model,
    optimizer, batch, seed, precision). Among the folders of its family, the run that can continue
    as the effective experiment (andrea.spec.config.continuation_refusal) is reused, so an edit that
    only adds steps (a longer constant last phase, a new phase) resumes and extends it: first the
    run of this very experiment, else the one furthest on, else the first by name. Otherwise a new
    folder is named by the effective experiment's hash. The same config and files give the same
    folder.
    """
    name = wildcards.experiment
    experiment, _ = effective_experiment(name)
    digest = hashlib.sha256(code_version("train").encode())
    digest.update(Path(input.train).parent.name.encode())
    manifest = Path(f"{input.train}.manifest.json")
    digest.update(
        manifest.read_bytes()
        if manifest.is_file()
        else str(Path(input.train).stat().st_size).encode()
    )
    digest.update(config["engine"].encode())
    digest.update(experiment.trajectory_hash().encode())
    family = digest.hexdigest()[:IDENTITY_LENGTH]
    own = f"{family}-{short_hash(experiment.raw)}"
    runs = Path("results/runs") / name
    candidates = []
    for folder in sorted(runs.glob(f"{family}-*")):
        state = read_run_state(folder, name)
        if state is None:
            # this experiment's folder with no checkpoint yet: it starts over there
            if folder.name == own:
                candidates.append((2, 0, folder.name))
            continue
        old, step, tokens = (
            state.get(k) for k in ("experiment", "step", "train_tokens")
        )
        if not (
            isinstance(old, dict) and isinstance(step, int) and isinstance(tokens, int)
        ):
            continue  # a run from before runs recorded these: not continued
        if continuation_refusal(old, experiment, step, tokens) is None:
            candidates.append((0 if old == experiment.raw else 1, -step, folder.name))
    if candidates:
        return str(runs / min(candidates)[2])
    # a folder of this name holds a run that cannot continue as this experiment: the next free name
    n, folder = 1, own
    while (runs / folder).exists():
        n += 1
        folder = f"{own}-{n}"
    return str(runs / folder)


def code_version(stage):
    """sha256 of the source `stage` runs (andrea.common.hashing.code_hash). As a param it reruns the
    stage when that source changes: by content, so a checkout that leaves the text alone reruns
    nothing."""
    try:
        return code_hash(REPO, STAGE_CODE[stage])[:16]
    except AndreaError as err:
        raise WorkflowError(f"STAGE_CODE in workflow/rules/common.smk: {err}")
