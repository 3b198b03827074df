"""Experiment files: load, validate against the JSON Schema, expose as a frozen object.

`andrea/schemas/experiment.schema.json` is the one definition of the experiment format.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from andrea.common.errors import AndreaError
from andrea.common.hashing import config_hash


def experiment_schema() -> dict:
    return json.loads(resources.files("andrea").joinpath("schemas/experiment.schema.json").read_text())


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int


@dataclass(frozen=True)
class Experiment:
    raw: dict
    path: str

    @property
    def name(self) -> str:
        return self.raw["name"]

    @property
    def model(self) -> ModelShape:
        return ModelShape(**self.raw["model"])

    @property
    def batch_size(self) -> int:
        return self.raw["batch"]["batch_size"]

    @property
    def micro_batches(self) -> int:
        return self.raw["batch"]["micro_batches"]

    @property
    def loss_chunks(self) -> int:
        """Pieces of a micro-batch the classifier runs on, one at a time (memory.plan_model)."""
        return self.raw["batch"].get("loss_chunks", 1)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_batches

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    @property
    def optimizer(self) -> dict:
        return self.raw["optimizer"]

    @property
    def schedule(self) -> dict:
        return self.raw["schedule"]

    @property
    def intervals(self) -> dict:
        return self.raw["intervals"]

    @property
    def seed(self) -> int:
        return self.raw["seed"]

    @property
    def precision(self) -> str:
        return self.raw["precision"]

    @property
    def recompute(self) -> tuple[str, ...]:
        """Activations recomputed in the backward (memory for time; not part of the trajectory)."""
        return tuple(self.raw.get("recompute", ()))

    @property
    def recompute_layers(self) -> int | None:
        """How many layers, the first ones, recompute (None: all of them)."""
        return self.raw.get("recompute_layers")

    @property
    def memory_options(self) -> dict:
        """The Model keywords that trade time for memory (the same bits): recompute and the classifier's pieces."""
        return {"recompute": self.recompute, "recompute_layers": self.recompute_layers,
                "loss_chunks": self.loss_chunks}

    def phase_specs(self) -> list[dict]:
        """The phases as written; a one-phase experiment (train + schedule) is one phase "main" with
        the same schedule: warmup, then cosine decay to lr * min_lr_ratio."""
        if "phases" in self.raw:
            return self.raw["phases"]
        return [{"name": "main", "length": self.raw["train"],
                 "lr": {"warmup_steps": self.schedule["warmup_steps"], "decay": "cosine",
                        "final_ratio": self.schedule["min_lr_ratio"]}}]

    def program(self, n_train_tokens: int) -> "Program":
        """The phases with their step ranges, for a train split of n_train_tokens."""
        phases, start = [], 0
        for spec in self.phase_specs():
            steps = self._steps(spec["length"], n_train_tokens)
            phases.append(Phase(spec, start, start + steps, self))
            start += steps
        return Program(tuple(phases))

    def _steps(self, length: dict, n_train_tokens: int) -> int:
        if "steps" in length:
            return length["steps"]
        if "tokens" in length:
            return max(1, math.ceil(length["tokens"] / self.tokens_per_step))
        windows = (n_train_tokens - 1) // self.model.seq_len
        return max(1, math.ceil(length["epochs"] * windows / self.batch_size))

    def total_steps(self, n_train_tokens: int) -> int:
        """Steps of the run: the sum of its phases'."""
        return self.program(n_train_tokens).total_steps

    def trajectory_hash(self) -> str:
        """Hash of everything that decides the weights at a given step before the phases do (not intervals,
        name or phases: a phase not yet started may change on resume; Phase.hash covers each one)."""
        keys = ("model", "optimizer", "batch", "seed", "precision") + (() if "phases" in self.raw else ("schedule", "train"))
        if "phases" not in self.raw and "mixing" in self.raw:
            keys += ("mixing",)  # one phase: its mixing is the experiment's (with phases, Phase.hash covers it)
        return config_hash({k: self.raw[k] for k in keys})[:16]


@dataclass(frozen=True)
class Phase:
    spec: dict
    start: int  # first step (0-based) of the phase
    end: int  # one past its last step: the step count when it is finished
    exp: Experiment

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def loss_on(self) -> str:
        return self.spec.get("loss_on", "all")

    @property
    def intervals(self) -> dict:
        return {**self.exp.intervals, **self.spec.get("intervals", {})}

    @property
    def mixing(self) -> dict | None:
        """How the phase draws from the sources (andrea.store.mixing): its own, else the experiment's, else None."""
        return self.spec.get("mixing", self.exp.raw.get("mixing"))

    def lr_at(self, step: int) -> float:
        """Linear warmup to the peak, then constant, linear or cosine decay to peak * final_ratio at the
        phase's last step; a function of the step only."""
        lr = self.spec.get("lr", {})
        peak = lr.get("peak", self.exp.optimizer["lr"])
        warmup = lr.get("warmup_steps", 0)
        decay = lr.get("decay", "cosine")
        floor = peak * lr.get("final_ratio", 0.1)
        k, n = step - self.start, self.end - self.start
        if k < warmup:
            return peak * (k + 1) / warmup
        if decay == "constant":
            return peak
        progress = min(1.0, (k - warmup) / max(1, n - 1 - warmup))
        if decay == "linear":
            return peak + (floor - peak) * progress
        return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))

    def hash(self) -> str:
        """What decides this phase's steps: its spec (with the mixing it takes from the experiment) and where it
        starts."""
        inherited = self.mixing if "mixing" not in self.spec and "phases" in self.exp.raw else None
        return config_hash({"spec": self.spec, "start": self.start, **({"mixing": inherited} if inherited else {})})[:16]


@dataclass(frozen=True)
class Program:
    phases: tuple[Phase, ...]

    @property
    def total_steps(self) -> int:
        return self.phases[-1].end

    def phase_at(self, step: int) -> Phase:
        """The phase that step `step` (0-based: the step being taken) belongs to."""
        for phase in self.phases:
            if step < phase.end:
                return phase
        return self.phases[-1]

    def lr_at(self, step: int) -> float:
        return self.phase_at(step).lr_at(step)


# What decides every step whatever the program: a change to one of them changes the steps already run.
FIXED_SECTIONS = ("model", "optimizer", "batch", "seed", "precision")


def continuation_refusal(old_raw: dict, new: Experiment, step: int, n_train_tokens: int) -> str | None:
    """None when a run of the experiment `old_raw` (its state's `experiment`) stopped at `step` can continue as
    `new`: every step already run would be the same step in `new` (the fixed sections, and step by step the
    phase, learning rate, loss_on and mixing), so the continued run gives the bytes of `new` run from scratch.
    Else a short phrase saying what changed. Lengths in epochs count windows of a train split of n_train_tokens."""
    fixed = [k for k in FIXED_SECTIONS if old_raw.get(k) != new.raw.get(k)]
    if fixed:
        return f"the experiment changed since it was written (sections differing: {', '.join(fixed)})"
    if step <= 0:
        return None
    try:
        old = validate(old_raw, "the recorded experiment").program(n_train_tokens)
    except AndreaError as err:
        return f"the experiment it was written with is no longer valid ({err})"
    now = new.program(n_train_tokens)
    if now.total_steps < step:
        return f"the experiment now has {now.total_steps} steps, fewer than the {step} already run"
    for s in range(min(step, old.total_steps)):
        was, will = old.phase_at(s), now.phase_at(s)
        ran = f"phase {was.name!r} has already run (steps {was.start + 1}-{min(was.end, step)})"
        if was.name != will.name:
            return f"step {s + 1} ran in phase {was.name!r} and would be in phase {will.name!r}"
        if was.lr_at(s) != will.lr_at(s):
            return f"{ran} and its learning rate at step {s + 1} would change"
        if was.loss_on != will.loss_on:
            return f"{ran} and its loss_on would change ({was.loss_on} -> {will.loss_on})"
        if was.mixing != will.mixing:
            return f"{ran} and its mixing would change"
    return None


def _field_path(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def validate(raw: dict, path: str = "<experiment>", overrides: dict[str, str] | None = None) -> Experiment:
    """The experiment, or one sentence naming the file and field (and the --set item that wrote the field, when
    `overrides` maps the fields they set, as "phases.1.lr", to the items)."""
    import jsonschema

    def at(*fields: str) -> str:
        """Where an error in these fields is: the file, and the override that set one of them (or inside it)."""
        for key, item in (overrides or {}).items():
            if any(f == key or f.startswith(key + ".") or key.startswith(f + ".") for f in fields):
                return f"{path}: --set {item}"
        return path

    if isinstance(raw, dict) and "phases" in raw and ({"train", "schedule"} & raw.keys()):
        raise AndreaError(f"{at('phases', 'train', 'schedule')}: field 'phases': each phase sets its own length and "
                          "lr, so an experiment with phases has no 'train' or 'schedule'; drop them")
    if isinstance(raw, dict) and "phases" not in raw and not {"train", "schedule"} <= raw.keys():
        raise AndreaError(f"{at('phases', 'train', 'schedule')}: field '(top level)': give 'train' and 'schedule' "
                          "(one phase), or 'phases'")
    validator = jsonschema.Draft202012Validator(experiment_schema())
    errors = sorted(validator.iter_errors(raw), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        raise AndreaError(f"{at(_field_path(err))}: field '{_field_path(err)}': {err.message}")
    model = raw["model"]
    if model["d_model"] % model["n_head"]:
        raise AndreaError(
            f"{at('model.d_model', 'model.n_head')}: field 'model.d_model' ({model['d_model']}) must be divisible by "
            f"'model.n_head' ({model['n_head']})"
        )
    names = [p["name"] for p in raw.get("phases", ())]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise AndreaError(f"{at(*(f'phases.{i}.name' for i in range(len(names))))}: field 'phases': the name "
                          f"{twice!r} is used twice; each phase needs its own (NAME.archive/<phase>/ holds it)")
    layers = raw.get("recompute_layers")
    if layers is not None and layers > model["n_layer"]:
        raise AndreaError(f"{at('recompute_layers', 'model.n_layer')}: field 'recompute_layers' ({layers}) is more "
                          f"than 'model.n_layer' ({model['n_layer']}); give at most that, or leave it out to recompute "
                          "in every layer")
    batch = raw["batch"]
    if batch["batch_size"] % batch["micro_batches"]:
        raise AndreaError(
            f"{at('batch.batch_size', 'batch.micro_batches')}: field 'batch.batch_size' ({batch['batch_size']}) must be "
            f"divisible by 'batch.micro_batches' ({batch['micro_batches']})"
        )
    return Experiment(raw=raw, path=str(path))


# ---- --set KEY=VALUE ---------------------------------------------------------------------------------------
def _schema_at(schema: dict | None, root: dict) -> dict | None:
    """A schema node with its $ref (the only kind this schema uses: #/$defs/...) followed."""
    while schema and "$ref" in schema:
        node = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = {**node, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _override_value(text: str):
    """JSON when it parses (numbers, true/false/null, lists, objects, quoted strings), else the text itself; NaN
    and Infinity are no JSON numbers, so they stay text (and the schema refuses them where a number goes)."""
    def no_constant(name):
        raise ValueError(name)

    try:
        return json.loads(text, parse_constant=no_constant)
    except ValueError:
        return text


def _child_schema(schema: dict | None, key, root: dict) -> dict | None:
    """The schema of `key` inside an object or list whose schema is `schema` (None: unknown)."""
    schema = schema or {}
    if isinstance(key, int):
        return _schema_at(schema.get("items"), root)
    extra = schema.get("additionalProperties")
    return _schema_at(schema.get("properties", {}).get(key, extra if isinstance(extra, dict) else None), root)


def _apply_override(raw: dict, item: str, where: str, schema: dict) -> str:
    """Set one KEY=VALUE in `raw` (in place); the field it set, with list indices ("phases.1.lr.peak")."""
    key, eq, text = item.partition("=")
    parts = key.split(".")
    if not eq or not all(parts):
        raise AndreaError(f"{where}: --set {item}: give KEY=VALUE, KEY a dotted path into the experiment (phases by "
                          f"name: phases.main.length.steps=2000; list items by index: optimizer.betas.1=0.99); the "
                          f"keys at the top level: {', '.join(sorted(schema['properties']))}")
    node, node_schema, fields, i = raw, schema, [], 0
    while i < len(parts):
        part, here = parts[i], ".".join(parts[:i]) or "the top level"
        if isinstance(node, list) and fields == ["phases"]:
            # phases by name; a name may hold dots, so the longest name the rest of the path starts with
            names = [p.get("name") if isinstance(p, dict) else None for p in node]
            j = next((j for j in range(len(parts), i, -1) if ".".join(parts[i:j]) in names), None)
            if j is None:
                raise AndreaError(f"{where}: --set {item}: no phase {part!r}; the phases: "
                                  f"{', '.join(str(n) for n in names)}")
            index, i = names.index(".".join(parts[i:j])), j
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise AndreaError(f"{where}: --set {item}: {here} is a list and {part!r} is none of its indices; "
                                  f"give one of {', '.join(map(str, range(len(node))))}")
            index, i = int(part), i + 1
        elif isinstance(node, dict):
            props = (node_schema or {}).get("properties", {})
            if part not in node and part not in props and not isinstance((node_schema or {}).get("additionalProperties"), dict):
                raise AndreaError(f"{where}: --set {item}: no key {part!r} in {here}; the keys there: "
                                  f"{', '.join(sorted(set(node) | set(props)))}")
            index, i = part, i + 1
        else:
            raise AndreaError(f"{where}: --set {item}: {here} is a value ({json.dumps(node)}), not an object or a list "
                              f"with a key {part!r}; set {here} itself")
        fields.append(str(index))
        node_schema = _child_schema(node_schema, index, schema)
        if i == len(parts):
            node[index] = _override_value(text)
            break
        if isinstance(node, dict) and index not in node:
            # a key the schema has and the file leaves out: an object can be made to set a key of, a list can't
            if fields == ["phases"]:
                raise AndreaError(f"{where}: --set {item}: the experiment has one phase (train + schedule), not "
                                  "'phases'; set its length with train.steps (or train.epochs) and its rate with "
                                  "schedule.*")
            if (node_schema or {}).get("type") != "object":
                raise AndreaError(f"{where}: --set {item}: the experiment has no {'.'.join(parts[:i])!r} to set an "
                                  f"item of; set it whole (--set {'.'.join(parts[:i])}=JSON)")
            node[index] = {}
        node = node[index]
    return ".".join(fields)


def _apply(raw: dict, overrides, where: str) -> tuple[dict, dict[str, str]]:
    import copy

    schema = experiment_schema()
    out, fields = copy.deepcopy(raw), {}
    for item in overrides:
        fields[_apply_override(out, item, where, schema)] = item
    return out, fields


def apply_overrides(raw: dict, overrides: list[str], where: str) -> dict:
    """A new experiment dict: `raw` with each `--set KEY=VALUE` applied in order. KEY is a dotted path (phases by
    name, other lists by index) to a key the experiment has or its schema allows there; VALUE is JSON when it
    parses, else a string. An unknown path or a malformed item is one sentence naming `where` and the item."""
    return _apply(raw, overrides, where)[0]


def load_experiment(path: str | Path, overrides=()) -> Experiment:
    """The experiment file with the `--set` overrides applied, validated: an error the overrides cause names the
    one that set the field."""
    path = Path(path)
    if not path.is_file():
        raise AndreaError(f"{path}: experiment file not found; see config/experiments/ for examples")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise AndreaError(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    if not isinstance(raw, dict):
        raise AndreaError(f"{path}: an experiment must be a JSON object")
    raw, fields = _apply(raw, list(overrides), str(path))
    return validate(raw, str(path), fields)
