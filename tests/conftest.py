import json
from pathlib import Path

import numpy as np
import pytest

from andrea.shards import write_shard

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "config" / "experiments"


def pytest_collection_modifyitems(config, items):
    from andrea.engines import cuda_available

    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_experiment_raw():
    return json.loads((EXPERIMENTS / "ANDREA-tiny-TRAIN.json").read_text())


@pytest.fixture
def repetitive_data(tmp_path):
    """A small, highly repetitive token stream: a model that learns drives its loss far down."""
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 512, 200)
    folder = tmp_path / "tokens"
    folder.mkdir()
    write_shard(folder / "train.bin", np.tile(pattern, 60))
    write_shard(folder / "val.bin", np.tile(pattern, 10))
    return folder
