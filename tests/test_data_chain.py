"""The whole data chain through the real CLI, offline, on the embedded corpus (its pydocs domain):
outputs, byte-identical reruns (with 1 and 2 encoder workers), shards that decode to the ChatML
text, lineage."""

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from andrea.cli import main
from andrea.data import tokenize_shards
from andrea.data.chatml import ChatTokenizer
from andrea.common.hashing import sha256_file
from andrea.store.manifest import manifest_path, read_manifest
from andrea.store.shards import read_shard

DATA = "results/data"
ARTIFACTS = ["hermes3.parquet", "megachat/train.parquet", "megachat/val.parquet",
             "tokens-V4096/tokenizer.json", "tokens-V4096/train.bin", "tokens-V4096/val.bin",
             "tokens-V4096/train.mask.bin", "tokens-V4096/val.mask.bin"]
VOLATILE = ("wall_time_s", "created_utc", "git_commit")  # a commit may land between the two runs


def run_chain(root, threads):
    """Every stage with its default paths (results/data/...) under `root`, as a user would type them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(tokenize_shards, "ROWS_PER_WORKER", 1)  # use worker processes even on this small corpus
        for argv in (["pull-hermes3", "--source", "embedded:pydocs"], ["prep-megachat"], ["train-tokenizer"],
                     ["tokenize", "--threads", str(threads)]):
            assert main(argv) == 0, argv
    return root / DATA


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return [run_chain(tmp_path_factory.mktemp(f"run{threads}"), threads) for threads in (1, 2)]


def test_every_artifact_has_a_manifest_of_its_stage(runs):
    data = runs[0]
    stages = ["pull-hermes3", "prep-megachat", "prep-megachat", "train-tokenizer"] + ["tokenize"] * 4
    for name, stage in zip(ARTIFACTS, stages):
        manifest = read_manifest(data / name)
        assert manifest["stage"] == stage and manifest["sha256"] == sha256_file(data / name)
        assert manifest["inputs"] and manifest["wall_time_s"] >= 0
    pulled = read_manifest(data / "hermes3.parquet")
    assert pulled["inputs"][0]["uri"] == "andrea:data/embedded/pydocs.jsonl.gz"
    assert pulled["counts"]["rows_out"] == pq.read_metadata(data / "hermes3.parquet").num_rows >= 5000
    prep = read_manifest(data / "megachat/train.parquet")["counts"]
    assert prep["rows_in"] == prep["train_rows"] + prep["val_rows"] + prep["dropped_rows"]


def test_same_inputs_give_byte_identical_outputs(runs):
    first, second = runs
    for name in ARTIFACTS:
        assert sha256_file(first / name) == sha256_file(second / name), name
        manifests = [json.loads(manifest_path(run / name).read_text()) for run in runs]
        for manifest in manifests:
            for key in VOLATILE:
                manifest.pop(key)
        assert manifests[0] == manifests[1], name


def test_shards_decode_to_the_megachat_text(runs):
    data = runs[0]
    chat = ChatTokenizer.load(data / "tokens-V4096/tokenizer.json")
    assert chat.vocab_size == 4096
    for split in ("train", "val"):
        tokens = np.asarray(read_shard(data / f"tokens-V4096/{split}.bin"))
        manifest = read_manifest(data / f"tokens-V4096/{split}.bin")
        assert tokens.size == manifest["counts"]["tokens"]
        texts = pq.read_table(data / f"megachat/{split}.parquet", columns=["text"]).column("text").to_pylist()
        ends = np.flatnonzero(tokens == chat.endoftext_id)
        assert len(ends) == len(texts) == manifest["counts"]["conversations"] and ends[-1] == tokens.size - 1
        for i in (0, len(texts) // 2, len(texts) - 1):
            start = ends[i - 1] + 1 if i else 0
            assert chat.decode(tokens[start:ends[i]]) == texts[i]


def test_lineage_prints_the_chain_back_to_the_pull(runs, capsys):
    assert main(["lineage", str(runs[0] / "tokens-V4096/train.bin")]) == 0
    out = capsys.readouterr().out
    for stage in ("[tokenize]", "[train-tokenizer]", "[prep-megachat]", "[pull-hermes3]", "pydocs.jsonl.gz"):
        assert stage in out
    assert " modified" not in out and " missing" not in out


def test_lineage_notices_a_changed_input(runs, tmp_path, capsys):
    copy = tmp_path / "data"
    shutil.copytree(runs[0], copy)
    with open(copy / "megachat/train.parquet", "ab") as f:
        f.write(b"tampered")
    assert main(["lineage", "--json", str(copy / "tokens-V4096/train.bin")]) == 1
    tree = json.loads(capsys.readouterr().out)
    assert tree["status"] == "ok" and tree["inputs"][1]["status"] == "modified"
