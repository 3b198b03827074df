"""pull-hermes3 on hostile records: an integer too long to convert, a weight no float holds, a
`source` that is not valid Unicode, a JSON array (one-line too) with an unbalanced element, a folder
given as the source. Each bad record is one counted drop, every other row is kept exactly, and
nothing ends in a traceback."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andrea.cli import main
from andrea.store.manifest import read_manifest

BIG = "7" * 4301  # one digit past Python's limit on converting digits to an int
N = 30


def row(i):
    return {"conversations": [{"from": "human", "value": f"Grüß dich, question {i}? \"q\" \\ 🙂"},
                              {"from": "gpt", "value": f"answer {i}\n\tend", "weight": 1}],
            "source": f"src{i}"}


def expected(rows, dropped):
    return [{"conversations": [{**t, "weight": float(t["weight"]) if "weight" in t else None}
                               for t in r["conversations"]], "source": r["source"]}
            for i, r in enumerate(rows) if i not in dropped]


def records(rows, bad):
    """Each row as JSON text, those in `bad` ({index: (placeholder, raw text)}) with the raw text put
    in place of their placeholder (JSON that json.dumps cannot write)."""
    texts = [json.dumps(r, ensure_ascii=False) for r in rows]
    for i, (placeholder, raw) in bad.items():
        texts[i] = texts[i].replace(json.dumps(placeholder), raw)
    return texts


def write(path, texts):
    """The records as JSON Lines (gzip'd for .gz), a one-line JSON array (.json) or an indented one
    (pretty.json)."""
    if path.name == "pretty.json":
        data = "[\n" + ",\n".join("  " + t for t in texts) + "\n]\n"
    elif path.name.endswith(".json"):
        data = "[" + ", ".join(texts) + "]"
    else:
        data = "".join(t + "\n" for t in texts)
    data = data.encode("utf-8", errors="surrogateescape")
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def pull(tmp_path, source, capsys):
    out = tmp_path / "out.parquet"
    assert main(["pull-hermes3", "--source", str(source), "--out", str(out)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    return read_manifest(out), pq.read_table(out).to_pylist()


FORMATS = ["chats.jsonl", "chats.jsonl.gz", "chats.json", "pretty.json"]


def line_of(name, i):
    return f"{name}:{1 if name == 'chats.json' else i + 1 + (name == 'pretty.json')}"


@pytest.mark.parametrize("name", FORMATS)
def test_an_integer_too_long_to_convert_is_one_drop(tmp_path, capsys, name):
    rows = [row(i) for i in range(N)]
    rows[4]["id"] = "BIG"
    rows[17]["conversations"][0]["weight"] = "BIG"
    texts = records(rows, {4: ("BIG", BIG), 17: ("BIG", "-" + BIG)})
    manifest, pulled = pull(tmp_path, write(tmp_path / name, texts), capsys)
    assert manifest["counts"] == {"rows_in": N, "rows_out": N - 2}
    assert manifest["dropped"] == {"integer_too_long": 2}
    assert manifest["dropped_at"] == {"integer_too_long": [line_of(name, 4), line_of(name, 17)]}
    assert pulled == expected(rows, {4, 17})


def test_an_integer_too_long_in_json_typed_parquet_is_one_drop(tmp_path, capsys):
    rows = [row(i) for i in range(N)]
    rows[9]["conversations"][1]["weight"] = "BIG"
    texts = records([r["conversations"] for r in rows], {9: ("BIG", BIG)})
    features = {"conversations": {"_type": "Json"}, "source": {"dtype": "string", "_type": "Value"}}
    table = pa.table({"conversations": texts, "source": [r["source"] for r in rows]})
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    pq.write_table(table, tmp_path / "typed.parquet")
    manifest, pulled = pull(tmp_path, tmp_path / "typed.parquet", capsys)
    assert manifest["dropped_at"] == {"integer_too_long": ["typed.parquet:10"]}
    assert pulled == expected(rows, {9})


@pytest.mark.parametrize("weight", ["1" + "0" * 400, "-1" + "0" * 400, "1e400", "-1e400", "NaN", "Infinity"])
@pytest.mark.parametrize("name", ["chats.jsonl", "chats.json"])
def test_a_weight_no_float_holds_is_one_drop(tmp_path, capsys, name, weight):
    rows = [row(i) for i in range(N)]
    rows[11]["conversations"][1]["weight"] = "W"
    manifest, pulled = pull(tmp_path, write(tmp_path / name, records(rows, {11: ("W", weight)})), capsys)
    assert manifest["dropped"] == {"bad_weight": 1}
    assert manifest["dropped_at"] == {"bad_weight": [line_of(name, 11)]}
    assert pulled == expected(rows, {11})


@pytest.mark.parametrize("name", FORMATS)
def test_a_source_that_is_not_valid_unicode_is_one_drop(tmp_path, capsys, name):
    rows = [row(i) for i in range(N)]
    rows[3]["source"] = rows[21]["source"] = "S"
    # a lone surrogate as a JSON escape, and bytes that are not UTF-8
    texts = records(rows, {3: ("S", '"ab\\ud800"'), 21: ("S", '"caf\udce9"')})
    manifest, pulled = pull(tmp_path, write(tmp_path / name, texts), capsys)
    assert manifest["dropped"] == {"invalid_unicode": 2}
    assert manifest["dropped_at"] == {"invalid_unicode": [line_of(name, 3), line_of(name, 21)]}
    assert pulled == expected(rows, {3, 21})


def utf8_unchecked(values: list[bytes]) -> pa.Array:
    """A string array of the bytes as they are (pyarrow checks UTF-8 when it builds one from str)."""
    return pa.array(values, pa.binary()).view(pa.string())


def test_parquet_text_that_is_not_utf8_is_one_drop(tmp_path, capsys):
    rows = [row(i) for i in range(N)]
    sources = [r["source"].encode() for r in rows]
    sources[6] = b"caf\xe9"
    values = [t["value"].encode() for r in rows for t in r["conversations"]]
    values[2 * 19 + 1] = b"\xff answer"
    turns = pa.StructArray.from_arrays(
        [pa.array([t["from"] for r in rows for t in r["conversations"]]), utf8_unchecked(values),
         pa.array([t.get("weight") for r in rows for t in r["conversations"]], pa.float64())],
        names=["from", "value", "weight"])
    conversations = pa.ListArray.from_arrays(pa.array(range(0, 2 * N + 1, 2), pa.int32()), turns)
    table = pa.table({"conversations": conversations, "source": utf8_unchecked(sources)})
    pq.write_table(table, tmp_path / "bytes.parquet")
    manifest, pulled = pull(tmp_path, tmp_path / "bytes.parquet", capsys)
    assert manifest["dropped_at"] == {"invalid_unicode": ["bytes.parquet:7", "bytes.parquet:20"]}
    assert pulled == expected(rows, {6, 19})


def unclosed(text):
    return text[:-1]  # the element's closing }


def unterminated(text):
    return text.replace('"answer', 'answer', 1)  # a string without its opening quote


def unopened(text):
    return text.replace('[{"from"', '{"from"', 1)  # a turn list without its [


def stray(text):
    return text + "}"  # a bracket no element opened


def stray_close(text):
    return text + "]"  # a bracket that would end the array early


LAYOUTS = {"spaced": ("[", ", ", "]"), "tight": ("[", ",", "]"), "indented": ("[\n  ", ",\n  ", "\n]\n")}


@pytest.mark.parametrize("damage", [unclosed, unterminated, unopened, stray, stray_close])
@pytest.mark.parametrize("broken", [0, 14, N - 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_array_loses_only_its_broken_element(tmp_path, capsys, damage, broken, layout):
    rows = [row(i) for i in range(N)]
    texts = records(rows, {})
    texts[broken] = damage(texts[broken])
    start, separator, end = LAYOUTS[layout]
    path = tmp_path / "chats.json"
    path.write_text(start + separator.join(texts) + end, encoding="utf-8")
    manifest, pulled = pull(tmp_path, path, capsys)
    assert manifest["dropped"] == {"broken_json": 1}
    if damage in (stray, stray_close):  # the element is whole; the bracket after it is the record dropped
        assert manifest["counts"] == {"rows_in": N + 1, "rows_out": N}
        assert pulled == expected(rows, set())
    else:
        assert manifest["counts"] == {"rows_in": N, "rows_out": N - 1}
        assert pulled == expected(rows, {broken})


def test_a_folder_as_the_source_says_it_is_one(tmp_path, capsys):
    folder = tmp_path / "chats"
    folder.mkdir()
    write(folder / "train.jsonl", records([row(0)], {}))
    assert main(["pull-hermes3", "--source", str(folder), "--out", str(tmp_path / "out.parquet")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith(f"andrea pull-hermes3: error: {folder}: is a directory")
    assert "no such file" not in err[0] and f"--hub-id {folder}" in err[0]
