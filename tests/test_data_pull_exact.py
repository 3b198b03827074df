"""pull-hermes3 keeps every clean record with its exact text and counts every other one, with its
line: mixed types, turns with differing keys, broken lines, JSON arrays, datasets' JSON-typed
parquet, and the Hub path."""

import gzip
import json

import pyarrow.parquet as pq
import pytest

from andrea.cli import main
from andrea.data import pull_hermes3 as pull
from andrea.data import raw_rows
from andrea.common.errors import AndreaError
from andrea.store.manifest import read_manifest

TEXTS = ["Question 0?", "Grüß dich, ÄÖÜ ß", "日本語のテキスト", "tab\there\nnew line", 'quote " and \\ backslash',
         "emoji 🙂👍🏽", "<|im_start|>literal", "  leading and trailing  ", "\u2028line separator\u2029", "x" * 5000]


def row(i, weights=False):
    """A Hermes row whose texts are the i-th of TEXTS plus the row number (so rows differ)."""
    turns = [{"from": "human", "value": f"{TEXTS[i % len(TEXTS)]} #{i}"},
             {"from": "gpt", "value": f"answer {i}: {TEXTS[(i + 3) % len(TEXTS)]}"}]
    if weights and i % 3 == 0:  # the weight key on some turns only, as OpenHermes has it
        turns[0]["weight"], turns[1]["weight"] = 0, 1
    return {"conversations": turns}


def jsonl(rows):
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" if not isinstance(r, str) else r + "\n" for r in rows)


def pulled_values(out):
    return [[t["value"] for t in r["conversations"]] for r in pq.read_table(out).to_pylist()]


def raw_values(path):
    """The texts as the raw file holds them, read independently of the pull, one line at a time."""
    opener = gzip.open if path.name.endswith(".gz") else open
    values = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f.read().split("\n"):
            try:
                record = json.loads(line)
                turns = record["conversations"]
                if all(isinstance(t["value"], str) for t in turns):
                    values.append([t["value"] for t in turns])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return values


def pull_file(path, out):
    assert main(["pull-hermes3", "--source", str(path), "--out", str(out)]) == 0
    return read_manifest(out)


@pytest.mark.parametrize("name", ["mixed.jsonl", "mixed.jsonl.gz"])
def test_one_mixed_type_value_drops_one_row_and_no_text_changes(tmp_path, name):
    rows = [row(i) for i in range(300)]
    rows[137]["conversations"][1]["value"] = 42
    text = jsonl(rows).encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    manifest = pull_file(path, tmp_path / "out.parquet")
    assert manifest["counts"] == {"rows_in": 300, "rows_out": 299}
    assert manifest["dropped"] == {"content_not_text": 1}
    assert manifest["dropped_at"] == {"content_not_text": [f"{name}:138"]}
    kept = pulled_values(tmp_path / "out.parquet")
    assert kept == raw_values(path) == [[t["value"] for t in r["conversations"]] for r in rows if r is not rows[137]]
    assert not any(v.startswith('"') for turns in kept for v in turns), "no text stored as quoted JSON"


def test_turns_with_differing_keys_keep_every_row_and_their_weights(tmp_path):
    rows = [row(i, weights=True) for i in range(50)]
    path = tmp_path / "weights.jsonl"
    path.write_text(jsonl(rows), encoding="utf-8")
    manifest = pull_file(path, tmp_path / "out.parquet")
    assert manifest["counts"]["rows_out"] == 50 and manifest["dropped"] == {}
    pulled = pq.read_table(tmp_path / "out.parquet").to_pylist()
    for raw, got in zip(rows, pulled):
        assert [t.get("weight") for t in raw["conversations"]] == [t["weight"] for t in got["conversations"]]
        assert [t["value"] for t in raw["conversations"]] == [t["value"] for t in got["conversations"]]


def test_broken_lines_are_counted_with_their_line_numbers(tmp_path):
    lines = [json.dumps(row(i), ensure_ascii=False) for i in range(124)]
    lines[9] = lines[9][:-5]  # cut short
    lines[70] = '{"conversations": [{"from": "human", "value": "unterminated}]}'
    lines.insert(40, "")  # a blank line is not a record
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    manifest = pull_file(path, tmp_path / "out.parquet")
    assert manifest["counts"] == {"rows_in": 124, "rows_out": 122}
    assert manifest["dropped_at"] == {"broken_json": ["broken.jsonl:10", "broken.jsonl:72"]}
    assert pulled_values(tmp_path / "out.parquet") == raw_values(path)


def test_invalid_utf8_and_other_shapes_are_single_drops(tmp_path):
    good = [json.dumps(row(i), ensure_ascii=False).encode() for i in range(6)]
    lines = good[:2] + [b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}', b'"just a string"',
                        b'{"conversations": "not a list"}', b'{"conversations": [{"from": 7, "value": "x"}]}',
                        b'{"messages": [{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "Hi"}]}]}',
                        b'{"conversations": [{"from": "gpt", "value": "ok", "weight": "1"}]}'] + good[2:]
    path = tmp_path / "shapes.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    manifest = pull_file(path, tmp_path / "out.parquet")
    assert manifest["dropped"] == {"conversation_not_a_list": 1, "invalid_unicode": 1, "not_a_record": 1,
                                   "role_not_text": 1, "weight_not_a_number": 1}
    assert manifest["dropped_at"]["invalid_unicode"] == ["shapes.jsonl:3"]
    assert manifest["dropped_parts"] == {"image_url": 1}
    assert pulled_values(tmp_path / "out.parquet")[2] == ["Hi"]


def pretty_array(rows, broken=()):
    """A JSON array, one indented element per line group, with elements `broken` damaged."""
    parts = []
    for i, r in enumerate(rows):
        text = json.dumps(r, ensure_ascii=False, indent=2).replace("\n", "\n  ")
        if i in broken:
            text = text.replace('"value": "', '"value": "\n', 1)  # a raw newline inside a string
        parts.append("  " + text)
    return "[\n" + ",\n".join(parts) + "\n]\n"


@pytest.mark.parametrize("read_bytes", [1 << 20, 97])
@pytest.mark.parametrize("layout", ["pretty", "compact"])
def test_json_arrays_stream_and_skip_only_their_broken_elements(tmp_path, monkeypatch, read_bytes, layout):
    monkeypatch.setattr(raw_rows, "READ_BYTES", read_bytes)  # 97 bytes: elements cross many reads
    rows = [row(i) for i in range(40)]
    if layout == "pretty":
        text = pretty_array(rows, broken={5, 23})
        kept = [r for i, r in enumerate(rows) if i not in (5, 23)]
    else:
        items = [json.dumps(r, ensure_ascii=False) for r in rows]
        items[17] = items[17].replace('"human"', "human")  # a bare word
        text = "[" + ",".join(items) + "]"
        kept = [r for i, r in enumerate(rows) if i != 17]
    path = tmp_path / "chats.json"
    path.write_text(text, encoding="utf-8")
    manifest = pull_file(path, tmp_path / "out.parquet")
    assert manifest["dropped"] == {"broken_json": len(rows) - len(kept)}
    assert pulled_values(tmp_path / "out.parquet") == [[t["value"] for t in r["conversations"]] for r in kept]
    if layout == "pretty":
        starts = [i + 1 for i, line in enumerate(text.split("\n")) if line == "  {"]
        assert manifest["dropped_at"]["broken_json"] == [f"chats.json:{starts[5]}", f"chats.json:{starts[23]}"]


def test_a_json_array_cut_short_keeps_what_came_before(tmp_path):
    text = pretty_array([row(i) for i in range(10)])
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"answer 7')], encoding="utf-8")
    manifest = pull_file(path, tmp_path / "out.parquet")
    assert manifest["counts"]["rows_out"] == 7 and manifest["dropped"] == {"broken_json": 1}


def test_json_typed_parquet_from_datasets_is_decoded(tmp_path):
    import datasets

    rows = [row(i) for i in range(20)]
    rows[4]["conversations"][0]["value"] = 42
    path = tmp_path / "mixed.parquet"
    datasets.Dataset.from_list(rows, on_mixed_types="use_json").to_parquet(str(path))
    assert "arrow.json" in str(pq.read_schema(path)), "datasets stores the mixed field as JSON text"
    manifest = pull_file(path, tmp_path / "out.parquet")
    assert manifest["dropped_at"] == {"content_not_text": ["mixed.parquet:5"]}
    assert pulled_values(tmp_path / "out.parquet") == [[t["value"] for t in r["conversations"]]
                                                       for i, r in enumerate(rows) if i != 4]


def test_hub_layout_gives_the_same_guarantee(tmp_path):
    repo = tmp_path / "hub-repo"
    (repo / "data").mkdir(parents=True)
    rows = [row(i, weights=True) for i in range(30)]
    rows[11]["conversations"][1]["value"] = {"nested": "object"}
    lines = jsonl(rows).split("\n")
    lines[20] = lines[20][:10]
    (repo / "data" / "train.jsonl").write_text("\n".join(lines), encoding="utf-8")
    out = tmp_path / "out.parquet"
    assert main(["pull-hermes3", "--source", "hub", "--hub-id", str(repo), "--out", str(out)]) == 0
    manifest = read_manifest(out)
    assert manifest["dropped_at"] == {"broken_json": ["data/train.jsonl:21"], "content_not_text": ["data/train.jsonl:12"]}
    assert manifest["inputs"][0]["files"] == ["data/train.jsonl"]
    assert pulled_values(out) == raw_values(repo / "data" / "train.jsonl")


def test_a_truncated_gzip_fails_with_one_sentence(tmp_path):
    path = tmp_path / "chats.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl([row(i) for i in range(2000)]).encode())[:3000])
    with pytest.raises(AndreaError, match=r"chats\.jsonl\.gz: not a complete gzip file"):
        pull.pull_hermes3(str(path), tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()
