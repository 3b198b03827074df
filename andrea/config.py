"""Experiment files: load, validate against the JSON Schema, expose as a frozen object.

`andrea/schemas/experiment.schema.json` is the one definition of the experiment format.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from andrea.errors import AndreaError
from andrea.hashing import config_hash


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
        """How the phase draws from the sources (andrea.mixing): its own, else the experiment's, else None."""
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


def _field_path(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def validate(raw: dict, path: str = "<experiment>") -> Experiment:
    import jsonschema

    if isinstance(raw, dict) and "phases" in raw and ({"train", "schedule"} & raw.keys()):
        raise AndreaError(f"{path}: field 'phases': each phase sets its own length and lr, so an experiment with "
                          "phases has no 'train' or 'schedule'; drop them")
    if isinstance(raw, dict) and "phases" not in raw and not {"train", "schedule"} <= raw.keys():
        raise AndreaError(f"{path}: field '(top level)': give 'train' and 'schedule' (one phase), or 'phases'")
    validator = jsonschema.Draft202012Validator(experiment_schema())
    errors = sorted(validator.iter_errors(raw), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        raise AndreaError(f"{path}: field '{_field_path(err)}': {err.message}")
    model = raw["model"]
    if model["d_model"] % model["n_head"]:
        raise AndreaError(
            f"{path}: field 'model.d_model' ({model['d_model']}) must be divisible by "
            f"'model.n_head' ({model['n_head']})"
        )
    names = [p["name"] for p in raw.get("phases", ())]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise AndreaError(f"{path}: field 'phases': the name {twice!r} is used twice; each phase needs its own "
                          "(NAME.archive/<phase>/ holds it)")
    layers = raw.get("recompute_layers")
    if layers is not None and layers > model["n_layer"]:
        raise AndreaError(f"{path}: field 'recompute_layers' ({layers}) is more than 'model.n_layer' "
                          f"({model['n_layer']}); give at most that, or leave it out to recompute in every layer")
    batch = raw["batch"]
    if batch["batch_size"] % batch["micro_batches"]:
        raise AndreaError(
            f"{path}: field 'batch.batch_size' ({batch['batch_size']}) must be divisible by "
            f"'batch.micro_batches' ({batch['micro_batches']})"
        )
    return Experiment(raw=raw, path=str(path))


def load_experiment(path: str | Path) -> Experiment:
    path = Path(path)
    if not path.is_file():
        raise AndreaError(f"{path}: experiment file not found; see config/experiments/ for examples")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise AndreaError(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    if not isinstance(raw, dict):
        raise AndreaError(f"{path}: an experiment must be a JSON object")
    return validate(raw, str(path))
