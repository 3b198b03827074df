"""Artifact manifests: contents, atomic writes, config hashes, lineage and its statuses."""

import json
import re
import shutil
import subprocess

import pytest

import andrea
from andrea.store import manifest as m
from andrea.common.errors import AndreaError


def make_artifact(path, text, stage, inputs, **extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return m.write_manifest(path, stage=stage, inputs=inputs, config={"k": 1}, counts={"rows": len(text)},
                            wall_time_s=0.5, **extra)


@pytest.fixture
def chain(tmp_path):
    """raw.json (no manifest) -> pulled.parquet -> train.parquet -> tokenizer.json, train.bin."""
    raw = tmp_path / "raw.json"
    raw.write_text("raw")
    pulled = tmp_path / "data" / "pulled.parquet"
    train = tmp_path / "data" / "megachat" / "train.parquet"
    tokenizer = tmp_path / "data" / "tokens" / "tokenizer.json"
    shard = tmp_path / "data" / "tokens" / "train.bin"
    make_artifact(pulled, "pulled", "pull-hermes3", [raw, {"uri": "hf://datasets/x/y", "revision": "abc"}])
    make_artifact(train, "train", "prep-megachat", [pulled], dropped={"empty_turn": 2, "duplicate": 1})
    make_artifact(tokenizer, "tok", "train-tokenizer", [train])
    make_artifact(shard, "shard", "tokenize", [tokenizer, train])
    return {"raw": raw, "pulled": pulled, "train": train, "tokenizer": tokenizer, "shard": shard}


def test_manifest_records_what_the_design_asks_for(chain):
    manifest = m.read_manifest(chain["train"])
    assert manifest["stage"] == "prep-megachat"
    assert manifest["sha256"] == m.sha256_file(chain["train"])
    assert manifest["inputs"] == [{"path": "../pulled.parquet", "sha256": m.sha256_file(chain["pulled"])}]
    assert manifest["config"] == {"k": 1} and manifest["config_sha256"] == m.config_hash({"k": 1})
    assert manifest["andrea_version"] == andrea.__version__
    assert manifest["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", manifest["git_commit"])
    assert manifest["counts"] == {"rows": 5}
    assert manifest["dropped"] == {"duplicate": 1, "empty_turn": 2}
    assert manifest["wall_time_s"] == 0.5
    assert not list(chain["train"].parent.glob(".*tmp*")), "no temp file left behind"


def test_config_hash_ignores_key_order():
    assert m.config_hash({"a": 1, "b": [1, 2]}) == m.config_hash({"b": [1, 2], "a": 1})
    assert m.config_hash({"a": 1}) != m.config_hash({"a": 2})


def test_git_commit_is_none_without_git(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert m.git_commit() is None


def test_read_manifest_errors_name_the_file(tmp_path):
    artifact = tmp_path / "x.parquet"
    with pytest.raises(AndreaError, match="no manifest"):
        m.read_manifest(artifact)
    m.manifest_path(artifact).write_text("{not json")
    with pytest.raises(AndreaError, match="not valid JSON"):
        m.read_manifest(artifact)
    m.manifest_path(artifact).write_text(json.dumps({"stage": "x"}))
    with pytest.raises(AndreaError, match="not an andrea manifest"):
        m.read_manifest(artifact)


def test_lineage_walks_back_to_the_raw_input(chain):
    root = m.lineage(chain["shard"])
    assert m.lineage_ok(root)
    tokenizer, train = root.inputs
    assert (tokenizer.stage, train.stage) == ("train-tokenizer", "prep-megachat")
    assert train.seen_above and not train.inputs, "an artifact reached twice is expanded once"
    pulled = tokenizer.inputs[0].inputs[0]
    assert pulled.stage == "pull-hermes3"
    raw, hub = pulled.inputs
    assert (raw.status, raw.stage) == ("ok", None)
    assert hub.status == "external" and "hf://datasets/x/y" in hub.label
    lines = m.format_lineage(root)
    assert len(lines) == 7
    assert lines[0].startswith(str(chain["shard"])) and "[tokenize]" in lines[0]
    assert "(inputs shown above)" in lines[-1]


def test_lineage_survives_moving_the_whole_tree(chain, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(chain["raw"], elsewhere / "raw.json")
    shutil.move(tmp_path / "data", elsewhere / "data")
    assert m.lineage_ok(m.lineage(elsewhere / "data" / "tokens" / "train.bin"))


def test_lineage_flags_modified_stale_and_missing(chain):
    chain["raw"].write_text("edited by hand")
    root = m.lineage(chain["train"])
    assert root.inputs[0].inputs[0].status == "modified"
    assert not m.lineage_ok(root)

    # rebuilding train.parquet after the tokenizer read it makes the tokenizer's input stale
    make_artifact(chain["train"], "train v2", "prep-megachat", [chain["pulled"]])
    assert m.lineage(chain["tokenizer"]).inputs[0].status == "stale"

    chain["shard"].write_text("corrupted")
    assert m.lineage(chain["shard"]).status == "modified"

    chain["pulled"].unlink()
    assert m.lineage(chain["train"]).inputs[0].status == "missing"
