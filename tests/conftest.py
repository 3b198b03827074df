import gzip
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from andrea.shards import write_shard

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "config" / "experiments"
N_CONVERSATIONS = 600  # embedded conversations the chat_data fixture uses


def write_experiment(folder: Path, raw: dict, name: str) -> Path:
    """An experiment JSON in `folder`."""
    path = folder / name
    path.write_text(json.dumps(raw))
    return path


def train_numpy(experiment, data, out, *extra) -> int:
    """`andrea train` on the NumPy engine, in-process; its exit status."""
    from andrea.cli import main

    return main(["train", "--experiment", str(experiment), "--data", str(data), "--out", str(out),
                 "--engine", "numpy", *extra])


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


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory):
    """The data stages, in-process, on the first conversations of the embedded corpus: a folder
    with train.bin, val.bin and a 512-token tokenizer.json, as `andrea tokenize` leaves it."""
    from andrea.data.embedded_corpus import corpus_file
    from andrea.data.prep_megachat import prep_megachat
    from andrea.data.pull_hermes3 import pull_hermes3
    from andrea.data.tokenize_shards import tokenize
    from andrea.data.train_tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("chat_data")
    corpus = corpus_file("pydocs")
    with gzip.open(corpus, "rt") as f:
        (root / "chats.jsonl").write_text("".join(itertools.islice(f, N_CONVERSATIONS)))
    pull_hermes3(str(root / "chats.jsonl"), root / "raw.parquet")
    prep_megachat(root / "raw.parquet", root / "megachat", val_fraction=0.1)
    tokens = root / "tokens"
    train_tokenizer(root / "megachat" / "train.parquet", 512, tokens / "tokenizer.json")
    tokenize(tokens / "tokenizer.json", root / "megachat", tokens, threads=1)
    return tokens


@pytest.fixture(scope="session")
def two_sources(tmp_path_factory):
    """The data stages, in-process, on the first conversations of both embedded domains: a folder of
    two sources (pydocs/, wordnet/ with shards and masks, their union, a 512-token tokenizer.json)."""
    from andrea.data.embedded_corpus import corpus_file
    from andrea.data.prep_megachat import prep_megachat
    from andrea.data.pull_hermes3 import pull_hermes3
    from andrea.data.tokenize_shards import tokenize
    from andrea.data.train_tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("two_sources")
    megachat = {}
    for name in ("pydocs", "wordnet"):
        with gzip.open(corpus_file(name), "rt") as f:
            (root / f"{name}.jsonl").write_text("".join(itertools.islice(f, N_CONVERSATIONS)))
        pull_hermes3(str(root / f"{name}.jsonl"), root / name / "raw.parquet")
        prep_megachat(root / name / "raw.parquet", root / name / "megachat", val_fraction=0.1)
        megachat[name] = root / name / "megachat"
    tokens = root / "tokens"
    train_tokenizer([m / "train.parquet" for m in megachat.values()], 512, tokens / "tokenizer.json")
    tokenize(tokens / "tokenizer.json", None, tokens, threads=1, sources=megachat)
    return tokens
