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

    def total_steps(self, n_train_tokens: int) -> int:
        """Steps of the run: given directly, or from epochs over a train shard of n_train_tokens."""
        train = self.raw["train"]
        if "steps" in train:
            return train["steps"]
        windows = (n_train_tokens - 1) // self.model.seq_len
        return max(1, math.ceil(train["epochs"] * windows / self.batch_size))

    def trajectory_hash(self) -> str:
        """Hash of everything that decides the weights at a given step (not intervals or name)."""
        keys = ("model", "optimizer", "schedule", "batch", "train", "seed", "precision")
        return config_hash({k: self.raw[k] for k in keys})[:16]


def _field_path(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def validate(raw: dict, path: str = "<experiment>") -> Experiment:
    import jsonschema

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
