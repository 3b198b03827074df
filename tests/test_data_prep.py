"""prep-megachat: schemas, normalisation, drop reasons, dedup, split; malformed rows never crash it."""

from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from andrea.cli import main
from andrea.data.conversations import DROP_REASONS, clean_text
from andrea.data.prep_megachat import megachat_records, split_of
from andrea.manifest import read_manifest


def hermes(*turns, source=None):
    row = {"conversations": [{"from": r, "value": v} for r, v in turns]}
    return row if source is None else {**row, "source": source}


def openai(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def prep(rows, val_fraction=0.0):
    dropped = Counter()
    records = list(megachat_records(rows, val_fraction, dropped))
    return [record for _, record in records], dropped


@pytest.mark.parametrize("row, reason", [
    ("just a string", "not_a_record"),
    (None, "not_a_record"),
    ({"text": "hello"}, "no_conversation"),
    ({"conversations": None, "messages": None}, "no_conversation"),
    ({"conversations": "hi"}, "conversation_not_a_list"),
    ({"conversations": []}, "empty_conversation"),
    ({"conversations": ["hi"]}, "turn_not_a_record"),
    ({"conversations": [{"value": "hi"}]}, "role_missing"),
    ({"messages": [{"role": 3, "content": "hi"}]}, "role_missing"),
    ({"messages": [{"role": "user"}]}, "content_not_text"),
    ({"messages": [{"role": "user", "content": 42}]}, "content_not_text"),
    (hermes(("narrator", "once upon a time"), ("gpt", "ok")), "unknown_role"),
    (hermes(("human", "bad \ud800 surrogate"), ("gpt", "ok")), "invalid_unicode"),
    (hermes(("human", " \n\t \r\n"), ("gpt", "ok")), "empty_turn"),
    (hermes(("system", "be brief"), ("human", "hi")), "no_assistant_turn"),
])
def test_each_malformed_row_is_dropped_with_its_reason(row, reason):
    kept, dropped = prep([row])
    assert kept == [] and dropped == {reason: 1}
    assert reason in DROP_REASONS


def test_both_schemas_map_to_chatml_roles():
    kept, dropped = prep([
        hermes(("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello"), source="s1"),
        openai(("user", "Hi again"), ("assistant", [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}])),
        hermes(("Human", "case"), ("GPT", "insensitive")),
    ])
    assert not dropped
    assert [t["role"] for t in kept[0]["turns"]] == ["system", "user", "assistant"]
    assert kept[0]["source"] == "s1" and kept[1]["source"] == "unknown"
    assert kept[1]["turns"][1]["content"] == "Hello"
    assert kept[0]["text"] == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                              "<|im_start|>assistant\nHello<|im_end|>\n"
    assert kept[0]["n_turns"] == 3
    assert [t["role"] for t in kept[2]["turns"]] == ["user", "assistant"]


def test_text_is_normalised():
    assert clean_text("cafe\u0301") == "caf\u00e9"  # NFC
    assert clean_text("\n\n  a  \r\nb\t\r\n\n\n\n\nc\u2028d\x00\n\n") == "  a\nb\n\nc\nd"


def test_duplicates_are_dropped_across_schemas_and_whitespace():
    kept, dropped = prep([
        hermes(("human", "Hi"), ("gpt", "Hello")),
        openai(("user", "Hi  "), ("assistant", "Hello\r\n")),
        hermes(("human", "Hi"), ("gpt", "Hello"), source="other"),
    ])
    assert len(kept) == 1 and dropped == {"duplicate": 2}


def test_split_depends_only_on_the_conversation():
    rows = [hermes(("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(400)]
    dropped = Counter()
    together = {record["id"]: split for split, record in megachat_records(rows, 0.25, dropped)}
    alone = {record["id"]: split for row in rows for split, record in megachat_records([row], 0.25, dropped)}
    assert together == alone
    assert 50 < Counter(together.values())["val"] < 150
    assert split_of("0" * 64, 0.001) == "val" and split_of("f" * 64, 0.999) == "train"


# Anything JSON-ish, and then rows built from the schema's own keys so that many get deep
# into validation before failing; strings include lone surrogates and long runs.
texts = st.one_of(st.text(max_size=20), st.text(min_size=1, max_size=8).map(lambda s: s * 2000),
                  st.sampled_from(["\ud800", "a\udfffb", ""]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), texts)
anything = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
roles = st.one_of(st.sampled_from(["system", "human", "gpt", "user", "assistant", "tool", "robot", " GPT "]), anything)
turns = st.fixed_dictionaries(
    {}, optional={"from": roles, "value": texts | anything, "role": roles, "content": texts | anything},
)
rows = st.one_of(
    anything,
    st.fixed_dictionaries({}, optional={"conversations": st.lists(turns, max_size=4) | anything,
                                        "messages": st.lists(turns, max_size=4) | anything,
                                        "source": texts | anything}),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(rows, max_size=12), st.floats(0.0, 0.99))
def test_prep_never_crashes_and_counts_every_row(batch, val_fraction):
    dropped = Counter()
    records = list(megachat_records(batch, val_fraction, dropped))
    assert len(records) + sum(dropped.values()) == len(batch)
    assert set(dropped) <= set(DROP_REASONS)
    for split, record in records:
        assert split in ("train", "val")
        assert record["text"].encode("utf-8")
        assert all(t["content"] and t["role"] in ("system", "user", "assistant", "tool") for t in record["turns"])


def test_prep_cli_reads_mixed_parquet_and_counts_drops(tmp_path):
    hermes_turns = pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))
    openai_turns = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    table = pa.table({
        "conversations": pa.array([
            [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}], None, [],
            [{"from": "human", "value": "x"}, {"from": "gpt", "value": "  "}], None,
        ], hermes_turns),
        "messages": pa.array([None, [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}], None,
                              None, None], openai_turns),
        "source": ["a", "b", "c", "d", "e"],
    })
    pq.write_table(table, tmp_path / "mixed.parquet")
    assert main(["prep-megachat", "--in", str(tmp_path / "mixed.parquet"), "--out-dir", str(tmp_path / "out"),
                 "--val-fraction", "0"]) == 0
    train = pq.read_table(tmp_path / "out" / "train.parquet")
    assert train.column_names == ["id", "source", "n_turns", "text", "turns"]
    assert train.column("source").to_pylist() == ["a", "b"]
    assert pq.read_table(tmp_path / "out" / "val.parquet").num_rows == 0
    manifest = read_manifest(tmp_path / "out" / "train.parquet")
    assert manifest["dropped"] == {"empty_conversation": 1, "empty_turn": 1, "no_conversation": 1}
    assert manifest["counts"]["rows_in"] == 5 == manifest["counts"]["train_rows"] + sum(manifest["dropped"].values())
