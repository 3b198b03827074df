"""The embedded corpus: every domain verifies and reads, its rows are Hermes-3, the domains differ,
the generator rebuilds what this machine has the upstream data for, and a changed file is refused."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from andrea.data import embedded_corpus
from andrea.data.embedded_corpus import DOMAINS, corpus_file, info, iter_rows
from andrea.common.errors import AndreaError

GENERATOR = Path(__file__).resolve().parent.parent / "scripts" / "make_embedded_corpus.py"


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict]]:
    return {domain: list(iter_rows(domain)) for domain in DOMAINS}


def text_bytes(conversations: list[dict]) -> int:
    return sum(len(turn["value"].encode()) for row in conversations for turn in row["conversations"])


def test_each_domain_ships_its_file_info_and_licence():
    assert DOMAINS[0] == "pydocs" and len(DOMAINS) >= 2 and len(set(DOMAINS)) == len(DOMAINS)
    for domain in DOMAINS:
        meta = info(domain)
        assert corpus_file(domain).is_file() and meta["file"] == corpus_file(domain).name
        assert meta["domain"] == domain and len(meta["sha256"]) == 64
        assert (corpus_file(domain).parent / meta["license_file"]).read_text(encoding="utf-8").strip()
        assert meta["license"] and meta["upstream"]["name"] and meta["upstream"]["version"]
        assert meta["generator"] == f"python scripts/make_embedded_corpus.py --domain {domain}"


def test_every_domain_reads_as_its_info_counts(rows):
    for domain in DOMAINS:
        meta = info(domain)
        assert len(rows[domain]) == meta["conversations"]
        assert text_bytes(rows[domain]) == meta["text_bytes"]
        sources: dict[str, int] = {}
        for row in rows[domain]:
            sources[row["source"]] = sources.get(row["source"], 0) + 1
        assert sources == meta["sources"]


def test_rows_are_hermes3_conversations(rows):
    for domain in DOMAINS:
        for row in rows[domain]:
            assert set(row) == {"conversations", "source"} and row["source"].startswith(f"{domain}/")
            turns = row["conversations"]
            assert all(set(turn) == {"from", "value"} for turn in turns)
            assert all(isinstance(turn["value"], str) and turn["value"].strip() for turn in turns)
            roles = [turn["from"] for turn in turns]
            if roles[0] == "system":
                roles = roles[1:]
            assert roles and roles == ["human", "gpt"] * (len(roles) // 2), row


def test_domains_differ_in_nature_and_the_corpus_has_grown(rows):
    sources = {domain: {row["source"] for row in rows[domain]} for domain in DOMAINS}
    questions = {domain: {row["conversations"][-2]["value"] for row in rows[domain]} for domain in DOMAINS}
    for i, a in enumerate(DOMAINS):
        for b in DOMAINS[i + 1:]:
            assert not sources[a] & sources[b] and not questions[a] & questions[b]
    # the Python documentation alone was the whole corpus before the other domains came
    assert sum(info(domain)["text_bytes"] for domain in DOMAINS) >= 3 * info("pydocs")["text_bytes"]


@pytest.fixture
def generator(monkeypatch):
    """scripts/make_embedded_corpus.py as a module (registered first: its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location("make_embedded_corpus", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("domain", DOMAINS)
def test_generator_rebuilds_the_committed_domain(domain, generator):
    committed = info(domain)["upstream"]
    here = generator.upstream_version(domain)
    if here is None:
        pytest.skip(f"{committed['name']} is not installed here, so {domain} cannot be regenerated")
    if here != committed["version"]:
        pytest.skip(f"{domain} was made from {committed['name']} {committed['version']}; this machine has {here}")
    result = subprocess.run([sys.executable, str(GENERATOR), "--check", "--domain", domain],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and f"{domain}: matches" in result.stdout, result.stdout + result.stderr


@pytest.fixture
def copied_corpus(tmp_path, monkeypatch) -> Path:
    """The pydocs domain's files in a temp folder that the module reads instead of the package's."""
    for name in ("pydocs.json", "pydocs.jsonl.gz"):
        shutil.copy(embedded_corpus.EMBEDDED_DIR / name, tmp_path / name)
    monkeypatch.setattr(embedded_corpus, "EMBEDDED_DIR", tmp_path)
    return tmp_path


def assert_one_sentence(error: pytest.ExceptionInfo, path: Path, says: str):
    message = str(error.value)
    assert message.startswith(str(path)) and says in message and "\n" not in message and ". " not in message
    assert "reinstall andrea or regenerate it with scripts/make_embedded_corpus.py" in message


def test_a_changed_file_is_refused_before_any_row(copied_corpus):
    assert next(iter_rows("pydocs"))["source"].startswith("pydocs/")
    path = copied_corpus / "pydocs.jsonl.gz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(AndreaError) as error:
        iter_rows("pydocs")
    assert_one_sentence(error, path, "does not match pydocs.json")


def test_a_missing_file_is_refused(copied_corpus):
    (copied_corpus / "pydocs.jsonl.gz").unlink()
    with pytest.raises(AndreaError) as error:
        iter_rows("pydocs")
    assert_one_sentence(error, copied_corpus / "pydocs.jsonl.gz", "is missing")
    (copied_corpus / "pydocs.json").unlink()
    with pytest.raises(AndreaError) as error:
        info("pydocs")
    assert_one_sentence(error, copied_corpus / "pydocs.json", "is missing")


def test_an_unknown_domain_names_the_known_ones():
    for call in (corpus_file, info, iter_rows):
        with pytest.raises(AndreaError, match="known domains are " + ", ".join(DOMAINS)):
            call("nosuchdomain")
