"""prep-megachat: schemas, the turn policy, normalisation, drop reasons, dedup, split; malformed rows
never crash it."""

from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from andrea.cli import main
from andrea.data.conversations import DROP_REASONS, TURN_DROP_REASONS, clean_text
from andrea.data.drops import Drops
from andrea.data.prep_megachat import megachat_records, split_of
from andrea.store.manifest import read_manifest


def hermes(*turns, source=None):
    row = {"conversations": [{"from": r, "value": v} for r, v in turns]}
    return row if source is None else {**row, "source": source}


def openai(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def prep(rows, val_fraction=0.0, turn_drops=None, parts=None):
    drops = Drops()
    records = list(megachat_records(rows, val_fraction, drops, turn_drops, parts))
    return [record for _, record in records], drops.counts


def roles_of(record):
    return [t["role"] for t in record["turns"]]


@pytest.mark.parametrize("row, reason", [
    ("just a string", "not_a_record"),
    (None, "not_a_record"),
    ({"text": "hello"}, "no_conversation"),
    ({"conversations": None, "messages": None}, "no_conversation"),
    ({"conversations": "hi"}, "conversation_not_a_list"),
    ({"conversations": []}, "empty_conversation"),
    ({"conversations": ["hi"]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": 42}, {"role": "assistant"}]}, "no_assistant_turn"),
    (hermes(("narrator", "once upon a time"), ("robot", "ok")), "no_assistant_turn"),
    (hermes(("human", "hi"), ("gpt", " \n\t \r\n")), "no_assistant_turn"),
    (hermes(("system", "be brief"), ("human", "hi")), "no_assistant_turn"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok", "weight": 0.5}]},
     "bad_weight"),
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
    assert roles_of(kept[0]) == ["system", "user", "assistant"]
    assert [t["weight"] for t in kept[0]["turns"]] == [1, 1, 1], "no weight given: every turn counts"
    assert kept[0]["source"] == "s1" and kept[1]["source"] == "unknown"
    assert kept[1]["turns"][1]["content"] == "Hello"
    assert kept[0]["text"] == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                              "<|im_start|>assistant\nHello<|im_end|>\n"
    assert kept[0]["n_turns"] == 3
    assert roles_of(kept[2]) == ["user", "assistant"]


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
    together = {record["id"]: split for split, record in megachat_records(rows, 0.25, Drops())}
    alone = {record["id"]: split for row in rows for split, record in megachat_records([row], 0.25, Drops())}
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
    drops, turn_drops = Drops(), Counter()
    records = list(megachat_records(batch, val_fraction, drops, turn_drops))
    assert len(records) + drops.total == len(batch)
    assert set(drops.counts) <= set(DROP_REASONS) and set(turn_drops) <= set(TURN_DROP_REASONS)
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
            [{"from": "system", "value": ""}, {"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}],
            [{"from": "human", "value": "x"}, {"from": "gpt", "value": "  "}], None,
        ], hermes_turns),
        "messages": pa.array([None, [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}], None,
                              None, None, None], openai_turns),
        "source": ["a", "b", "c", "d", "e", "f"],
    })
    pq.write_table(table, tmp_path / "mixed.parquet")
    assert main(["prep-megachat", "--in", str(tmp_path / "mixed.parquet"), "--out-dir", str(tmp_path / "out"),
                 "--val-fraction", "0"]) == 0
    train = pq.read_table(tmp_path / "out" / "train.parquet")
    assert train.column_names == ["id", "source", "n_turns", "text", "turns"]
    assert train.column("source").to_pylist() == ["a", "b", "d"]
    assert pq.read_table(tmp_path / "out" / "val.parquet").num_rows == 0
    manifest = read_manifest(tmp_path / "out" / "train.parquet")
    assert manifest["dropped"] == {"empty_conversation": 1, "no_assistant_turn": 1, "no_conversation": 1}
    assert manifest["dropped_at"] == {"empty_conversation": ["mixed.parquet:3"], "no_assistant_turn": ["mixed.parquet:5"],
                                      "no_conversation": ["mixed.parquet:6"]}
    assert manifest["dropped_turns"] == {"empty_turn": 1}, "the empty system prompt of row d, not row e's"
    assert manifest["counts"]["rows_in"] == 6 == manifest["counts"]["train_rows"] + sum(manifest["dropped"].values())


def test_turn_policy_removes_turns_not_conversations():
    turn_drops, parts = Counter(), Counter()
    kept, dropped = prep([
        hermes(("system", ""), ("human", "Hi"), ("gpt", "Hello")),
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": None}, {"from": "gpt", "value": "A"}]},
        {"conversations": [None, {"from": "human", "value": "Q2"}, {"value": "no role"}, {"from": "gpt", "value": "A2"}]},
        hermes(("developer", "Be terse."), ("user", "Call it"), ("function_call", '{"name": "f"}'),
               ("observation", "42"), ("Function-Response", "43"), ("assistant", "It is 42.")),
        hermes(("narrator", "Meanwhile"), ("human", "Q3"), ("gpt", "A3")),
        openai(("user", [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "What is it?"}]),
               ("assistant", [{"type": "text", "text": "A cat."}, {"type": "input_audio"}, {"type": "weird"}])),
        hermes(("human", "dropped row"), ("gpt", "  ")),  # its turn drops are not counted
    ], turn_drops=turn_drops, parts=parts)
    assert dropped == {"no_assistant_turn": 1}
    assert [roles_of(r) for r in kept] == [
        ["user", "assistant"], ["user", "assistant"], ["user", "assistant"],
        ["system", "user", "tool", "tool", "tool", "assistant"], ["user", "assistant"], ["user", "assistant"]]
    assert turn_drops == {"empty_turn": 1, "content_missing": 1, "turn_not_a_record": 1, "role_missing": 1,
                          "unknown_role": 1}
    assert parts == {"image_url": 1, "input_audio": 1, "other": 1}
    assert kept[5]["turns"][0]["content"] == "What is it?" and kept[5]["turns"][1]["content"] == "A cat."
    assert kept[3]["turns"][2]["content"] == '{"name": "f"}'


def test_turn_weights_are_kept():
    rows = [{"conversations": [{"from": "system", "value": "S", "weight": 0}, {"from": "human", "value": "Q", "weight": 0.0},
                               {"from": "gpt", "value": "A1", "weight": 0}, {"from": "human", "value": "Q2"},
                               {"from": "gpt", "value": "A2", "weight": True}]}]
    kept, dropped = prep(rows)
    assert not dropped
    assert [t["weight"] for t in kept[0]["turns"]] == [0, 0, 0, 1, 1]
