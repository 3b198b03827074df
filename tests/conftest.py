import gzip
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from andrea.store.shards import write_shard

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "config" / "experiments"
N_CONVERSATIONS = 600  # embedded conversations the chat_data fixture uses


def write_experiment(folder: Path, raw: dict, name: str = "experiment.json") -> Path:
    """An experiment JSON in `folder`."""
    path = folder / name
    path.write_text(json.dumps(raw))
    return path


def train_numpy(experiment, data, out, *extra) -> int:
    """`andrea train` on the NumPy engine, in-process; its exit status."""
    from andrea.cli import main

    return main(["train", "--experiment", str(experiment), "--data", str(data), "--out", str(out),
                 "--engine", "numpy", *extra])


def fp8_history_row(history=(), name="act"):
    """A layer's row of precision fp8's history `name` at a run's start (andrea/ops/fp8.py), with `history` amaxes
    already folded in (host float32)."""
    from andrea.ops import fp8

    row = fp8.reset_history(np.zeros(fp8.history_field("ROW"), dtype=np.float32), name)
    for a in history:
        fp8.fold_amax(row, a, fp8.HISTORIES[name][0])
    return row


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


def data_stages(root: Path, chats, vocab_size: int, val_fraction: float = 0.1) -> Path:
    """pull-hermes3, prep-megachat, train-tokenizer and tokenize, in-process: one JSONL file gives the
    single-folder layout (ROOT/raw.parquet, ROOT/megachat, ROOT/tokens), {name: JSONL} a folder of sources
    (ROOT/<name>/raw.parquet, ROOT/<name>/megachat, ROOT/tokens/<name>/); returns ROOT/tokens."""
    from andrea.data.prep_megachat import prep_megachat
    from andrea.data.pull_hermes3 import pull_hermes3
    from andrea.data.tokenize_shards import tokenize
    from andrea.data.train_tokenizer import train_tokenizer

    named = chats if isinstance(chats, dict) else {None: chats}
    megachat = {}
    for name, path in named.items():
        where = root if name is None else root / name
        pull_hermes3(str(path), where / "raw.parquet")
        prep_megachat(where / "raw.parquet", where / "megachat", val_fraction=val_fraction)
        megachat[name] = where / "megachat"
    tokens = root / "tokens"
    if None in megachat:
        train_tokenizer(megachat[None] / "train.parquet", vocab_size, tokens / "tokenizer.json")
        tokenize(tokens / "tokenizer.json", megachat[None], tokens, threads=1)
    else:
        train_tokenizer([m / "train.parquet" for m in megachat.values()], vocab_size, tokens / "tokenizer.json")
        tokenize(tokens / "tokenizer.json", None, tokens, threads=1, sources=megachat)
    return tokens


def embedded_chats(path: Path, domain: str, n: int | None = N_CONVERSATIONS) -> Path:
    """The first n conversations of an embedded domain (None: all of them), as a JSONL file at `path`."""
    from andrea.data.embedded_corpus import corpus_file

    with gzip.open(corpus_file(domain), "rt") as f:
        path.write_text("".join(itertools.islice(f, n)))
    return path


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory):
    """The data stages, in-process, on the first conversations of the embedded corpus: a folder
    with train.bin, val.bin and a 512-token tokenizer.json, as `andrea tokenize` leaves it."""
    root = tmp_path_factory.mktemp("chat_data")
    return data_stages(root, embedded_chats(root / "chats.jsonl", "pydocs"), 512)


@pytest.fixture(scope="session")
def embedded_text(tmp_path_factory):
    """The data stages on the whole embedded corpus (both domains, about 4.5M tokens) with a 4,096-token
    tokenizer, as the default pipeline prepares it: real text for training comparisons (ids fit any vocabulary
    of at least 4,096)."""
    root = tmp_path_factory.mktemp("embedded_text")
    return data_stages(root, {name: embedded_chats(root / f"{name}.jsonl", name, None) for name in ("pydocs", "wordnet")},
                       4096)


@pytest.fixture(scope="session")
def two_sources(tmp_path_factory):
    """The data stages, in-process, on the first conversations of both embedded domains: a folder of
    two sources (pydocs/, wordnet/ with shards and masks, their union, a 512-token tokenizer.json)."""
    root = tmp_path_factory.mktemp("two_sources")
    return data_stages(root, {name: embedded_chats(root / f"{name}.jsonl", name) for name in ("pydocs", "wordnet")}, 512)
