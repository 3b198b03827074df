"""pull-hermes3 from local files, from a Hub-laid-out dataset folder, and the Hub's failure modes."""

import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andrea.cli import main
from andrea.data import pull_hermes3 as pull
from andrea.common.errors import AndreaError
from andrea.common.hashing import sha256_file
from andrea.store.manifest import read_manifest

OPENAI_ROWS = [
    {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}]},
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "source": "math"},
]
HERMES_ROWS = [
    {"conversations": [{"from": "human", "value": "Grüß dich"}, {"from": "gpt", "value": "Servus!"}]},
    {"conversations": [{"from": "human", "value": "Ping"}, {"from": "gpt", "value": "Pong"}]},
]
HERMES_TURNS = [
    {"from": "system", "value": "Be kind.", "weight": None}, {"from": "human", "value": "Hi", "weight": None},
    {"from": "gpt", "value": "Hello!", "weight": None},
]


def write_rows(path, rows):
    """The rows as a file of the type its name says."""
    if path.name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.name.endswith(".json"):
        path.write_text(json.dumps(rows, ensure_ascii=False))
    else:
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
        path.write_bytes(gzip.compress(lines) if path.name.endswith(".gz") else lines)
    return path


def run_cli(*args, **env):
    """The real console entry point in a fresh process, never touching the network or ~/.cache."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run([sys.executable, "-m", "andrea.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**environment, **env})


@pytest.mark.parametrize("name, rows", [
    ("chats.jsonl", OPENAI_ROWS), ("chats.json", OPENAI_ROWS), ("chats.jsonl.gz", OPENAI_ROWS),
    ("chats.parquet", HERMES_ROWS), ("chats.json", HERMES_ROWS),
])
def test_local_files_in_either_schema_become_hermes3(tmp_path, name, rows):
    source = write_rows(tmp_path / name, rows)
    out = tmp_path / "out" / "hermes3.parquet"
    assert main(["pull-hermes3", "--source", str(source), "--out", str(out)]) == 0
    table = pq.read_table(out)
    assert table.column_names == ["conversations", "source"]
    pulled = table.to_pylist()
    assert len(pulled) == 2
    if rows is OPENAI_ROWS:
        assert pulled[0]["conversations"] == HERMES_TURNS
        assert [r["source"] for r in pulled] == [name, "math"]
    else:
        assert pulled[0]["conversations"][0]["value"] == "Grüß dich"
    manifest = read_manifest(out)
    assert manifest["inputs"] == [{"path": f"../{name}", "sha256": sha256_file(source)}]
    assert manifest["counts"] == {"rows_in": 2, "rows_out": 2}


def test_hub_source_loads_a_dataset_laid_out_like_the_hub(tmp_path):
    repo = tmp_path / "Hermes-3-Dataset"
    (repo / "data").mkdir(parents=True)
    write_rows(repo / "data" / "train-00000-of-00001.parquet", HERMES_ROWS)
    out = tmp_path / "hermes3.parquet"
    result = run_cli("pull-hermes3", "--source", "hub", "--hub-id", str(repo), "--out", str(out),
                     HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert pq.read_table(out).column("source").to_pylist() == [str(repo)] * 2
    assert read_manifest(out)["inputs"] == [
        {"dataset": str(repo), "revision": None, "files": ["data/train-00000-of-00001.parquet"]}]


class FakeHub(BaseHTTPRequestHandler):
    """Answers dataset-info requests the way the Hub does for gated and missing repos."""

    def do_GET(self):
        code, error = (401, "GatedRepo") if "/gated/" in self.path else (404, "RepoNotFound")
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "no"}')

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fake_hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.parametrize("hub_id, env, says", [
    ("NousResearch/Hermes-3-Dataset", {"HF_HUB_OFFLINE": "1"}, "not in the local Hugging Face cache"),
    ("gated/chats", {}, "is gated on the Hugging Face Hub"),
    ("nobody/nothing", {}, "was not found on the Hugging Face Hub"),
    ("NousResearch/Hermes-3-Dataset", {"HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot reach the Hugging Face Hub"),
])
def test_hub_failures_say_why_and_what_to_do_instead(tmp_path, fake_hub, hub_id, env, says):
    env = {"HF_ENDPOINT": fake_hub, "HF_HOME": str(tmp_path / "hf"), **env}
    result = run_cli("pull-hermes3", "--source", "hub", "--hub-id", hub_id, "--out", str(tmp_path / "x.parquet"), **env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("andrea pull-hermes3: error: ") and says in lines[-1]
    assert "--source embedded" in lines[-1] and "Traceback" not in result.stderr
    assert not (tmp_path / "x.parquet").exists()


def test_embedded_domains_pull_one_or_all(tmp_path):
    from andrea.data.embedded_corpus import DOMAINS, info

    counts = {}
    for source in ("embedded", *(f"embedded:{d}" for d in DOMAINS)):
        manifest = pull.pull_hermes3(source, tmp_path / f"{source}.parquet")
        assert manifest["dropped"] == {} and manifest["config"] == {"source": source}
        counts[source] = manifest["counts"]["rows_out"]
    assert [i["uri"] for i in manifest["inputs"]] == [f"andrea:data/embedded/{DOMAINS[-1]}.jsonl.gz"]
    assert counts["embedded"] == sum(counts[f"embedded:{d}"] for d in DOMAINS) == sum(
        info(d)["conversations"] for d in DOMAINS)
    sources = set(pq.read_table(tmp_path / "embedded.parquet", columns=["source"]).column("source").to_pylist())
    assert {s.split("/")[0] for s in sources} == set(DOMAINS)


def test_embedded_corpus_is_verified_before_use(tmp_path, monkeypatch):
    from andrea.data import embedded_corpus

    for path in embedded_corpus.EMBEDDED_DIR.iterdir():
        shutil.copy(path, tmp_path / path.name)
    meta = json.loads((tmp_path / "pydocs.json").read_text())
    (tmp_path / "pydocs.json").write_text(json.dumps({**meta, "sha256": "0" * 64}))
    monkeypatch.setattr(embedded_corpus, "EMBEDDED_DIR", tmp_path)
    with pytest.raises(AndreaError, match="does not match"):
        pull.pull_hermes3("embedded", tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists(), "no row is read before every domain is verified"
    with pytest.raises(AndreaError, match="unknown embedded corpus domain 'nope'"):
        pull.pull_hermes3("embedded:nope", tmp_path / "out.parquet")


def test_rows_outside_both_schemas_are_dropped_and_counted(tmp_path):
    rows = OPENAI_ROWS + [{"messages": [{"role": "user", "content": "x"}], "conversations": None},
                          {"messages": None, "conversations": None}]
    source = write_rows(tmp_path / "mixed.jsonl", rows)
    pull.pull_hermes3(str(source), tmp_path / "out.parquet")
    manifest = read_manifest(tmp_path / "out.parquet")
    assert manifest["counts"] == {"rows_in": 4, "rows_out": 3} and manifest["dropped"] == {"no_conversation": 1}
