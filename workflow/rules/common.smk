import ast
import functools
import hashlib
import json
import os
import sys
from pathlib import Path

from jsonschema import Draft202012Validator
from snakemake.utils import min_version, validate

min_version("9.0")


validate(config, "../schemas/config.schema.yaml")

# The checkout this workflow belongs to: its `andrea/` and `kernels/` are what the jobs run
# (scripts/setup.sh installs the package editable from it).
REPO = Path(workflow.current_basedir).parents[1]
EXPERIMENT_DIR = Path("config/experiments")
EXPERIMENT_SCHEMA = REPO / "andrea" / "schemas" / "experiment.schema.json"

# `.venv/bin/snakemake` must find the `andrea` installed beside it without an activated venv;
# jobs inherit this PATH, also through sbatch (--export=ALL).
_bin = str(Path(sys.executable).parent)
if (Path(_bin) / "andrea").exists() and _bin not in os.environ["PATH"].split(os.pathsep):
    os.environ["PATH"] = _bin + os.pathsep + os.environ["PATH"]


wildcard_constraints:
    experiment="ANDREA-[A-Za-z0-9._-]+",
    vocab=r"\d+",


# ---- experiments -----------------------------------------------------------------------------


def experiment_path(name):
    return EXPERIMENT_DIR / f"{name}-TRAIN.json"


def experiment_names():
    return sorted(p.name.removesuffix("-TRAIN.json") for p in EXPERIMENT_DIR.glob("ANDREA-*-TRAIN.json"))


@functools.cache
def load_experiment(name):
    """The experiment JSON, checked against the package's schema (its one source of truth)."""
    path = experiment_path(name)
    if not path.is_file():
        raise WorkflowError(
            f"{path}: no such experiment file; experiments here: {', '.join(experiment_names()) or 'none'}. "
            f"Add the file or fix the name in config/config.yaml or the target."
        )
    try:
        experiment = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise WorkflowError(f"{path}: not valid JSON ({err}); fix the file.")
    schema = json.loads(EXPERIMENT_SCHEMA.read_text())
    for error in Draft202012Validator(schema).iter_errors(experiment):
        where = "/".join(map(str, error.absolute_path)) or "top level"
        raise WorkflowError(f"{path}: {where}: {error.message}; see {EXPERIMENT_SCHEMA.relative_to(REPO)}.")
    if experiment["name"] != name:
        raise WorkflowError(
            f"{path}: field `name` is {experiment['name']!r} but the file name says {name!r}; "
            f"outputs are named after the file, so make them agree."
        )
    return experiment


for _name in config["experiments"]:
    load_experiment(_name)


def experiment_file(wildcards):
    return str(experiment_path(wildcards.experiment))


def tokens_dir(name):
    """Token shards and tokenizer for an experiment: one folder per vocabulary size, shared by
    every experiment with that size."""
    return f"results/data/tokens-V{load_experiment(name)['model']['vocab_size']}"


def tokens_file(filename):
    """Input function: `filename` in the experiment's token folder."""

    def path(wildcards):
        return f"{tokens_dir(wildcards.experiment)}/{filename}"

    return path


# ---- data source -------------------------------------------------------------------------------


def pull_source_is_file():
    return config["data"]["source"] not in ("hub", "embedded")


def pull_inputs(wildcards):
    """A local source file is an input, so editing it reruns the pull."""
    return {"source": config["data"]["source"]} if pull_source_is_file() else {}


def pull_args():
    """The pull's flags; Hub settings only count (and only rerun the pull) when pulling from the Hub."""
    data = config["data"]
    if data["source"] == "hub":
        return f"--source hub --hub-id {data['hub_id']} --revision {data['revision']}"
    return f"--source {data['source']}"


# ---- threads -----------------------------------------------------------------------------------


def threads(stage):
    """Configured threads, at most this machine's CPUs: more BLAS threads than cores slow NumPy down.
    Snakemake also caps them at --cores and exports them as OMP_NUM_THREADS and friends."""
    return min(config["threads"][stage], len(os.sched_getaffinity(0)))


# ---- code versions -----------------------------------------------------------------------------

# What each stage runs. A dotted name is a module, hashed with every andrea module it imports
# (followed statically); a path is a file or folder hashed as is: the command-line front ends
# (not followed: they import every stage) and files read at run time rather than imported.
STAGE_CODE = {
    "pull_hermes3": ["andrea.data.pull_hermes3", "andrea/cli.py", "andrea/data/cli.py", "andrea/data/embedded"],
    "prep_megachat": ["andrea.data.prep_megachat", "andrea/cli.py", "andrea/data/cli.py"],
    "train_tokenizer": ["andrea.data.train_tokenizer", "andrea/cli.py", "andrea/data/cli.py"],
    "tokenize": ["andrea.data.tokenize_shards", "andrea/cli.py", "andrea/data/cli.py"],
    "train": ["andrea.train", "andrea/cli.py", "andrea/schemas", "kernels"],
    "eval": ["andrea.evaluate", "andrea/cli.py", "andrea/schemas", "kernels"],
}


def _module_file(module):
    path = REPO.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _andrea_imports(path):
    """andrea modules named by the imports of `path`, wherever in the file they are."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from andrea.data import chatml` may import a submodule
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for parts in (name.split(".") for name in names if name.split(".")[0] == "andrea"):
            # importing a.b.c also runs a/__init__.py and a/b/__init__.py
            yield from (".".join(parts[:i]) for i in range(1, len(parts) + 1))


def _stage_files(stage):
    files, todo = set(), []
    for entry in STAGE_CODE[stage]:
        if "/" in entry:
            path = REPO / entry
            if not path.exists():
                raise WorkflowError(f"{path}: listed in STAGE_CODE of workflow/rules/common.smk but missing.")
            files.update(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
        elif _module_file(entry) is None:
            raise WorkflowError(f"{entry}: listed in STAGE_CODE of workflow/rules/common.smk but not found.")
        else:
            todo.append(entry)
    seen = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_file(module)
        if path is None:
            continue
        files.add(path)
        todo.extend(_andrea_imports(path))
    return files


def code_version(stage):
    """sha256 of the source `stage` runs. As a param it reruns the stage when that source changes
    (content, not mtime: a checkout that leaves the text alone reruns nothing)."""
    digest = hashlib.sha256()
    for path in sorted(_stage_files(stage)):
        if "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
