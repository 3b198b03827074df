"""Random rows through pull and prep: neither crashes, every record is counted, and no kept text
differs from the raw file's (beyond prep's documented normalisation, `clean_text`)."""

import json
import tempfile
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from andrea.data.conversations import DROP_REASONS, TURN_DROP_REASONS, chatml_role, clean_text
from andrea.data.drops import Drops
from andrea.data.prep_megachat import megachat_records
from andrea.data.pull_hermes3 import pull_hermes3
from andrea.common.errors import AndreaError
from andrea.store.manifest import read_manifest

texts = st.one_of(st.text(max_size=30), st.sampled_from(["", " ", "\ud800", "\n\n", "Grüß 日本 🙂", "\u2028", "x" * 300]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), texts)
anything = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
role_names = st.sampled_from(["system", "human", "gpt", "user", "assistant", "tool", "developer", "function_call",
                              "observation", "narrator", " GPT "])
parts = st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                           st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "zz"])})),
                 max_size=3)
turns = st.one_of(
    st.none(),
    st.fixed_dictionaries({}, optional={"from": role_names | anything, "value": texts | parts | anything,
                                        "role": role_names, "content": texts | parts,
                                        "weight": st.sampled_from([0, 1, 0.0, 1.0, True, None, 0.5, "1"])}),
)
rows = st.one_of(
    anything,
    st.fixed_dictionaries({}, optional={"conversations": st.lists(turns, max_size=5) | anything,
                                        "messages": st.lists(turns, max_size=5)}),
)
# rows close to real ones, so that many reach prep's turn policy
plain_turns = st.fixed_dictionaries({"from": role_names, "value": texts | st.none()},
                                    optional={"weight": st.sampled_from([0, 1, None])})
good_rows = st.fixed_dictionaries({"conversations": st.lists(plain_turns, min_size=1, max_size=5)})
lines = st.lists(st.one_of(good_rows.map(json.dumps), good_rows.map(json.dumps), rows.map(lambda r: json.dumps(r)), st.sampled_from([' {"conversations": [', "{]", "nul"])),
                 max_size=12)


def raw_texts(row):
    """(role, text) of each turn the raw row holds as text (a string, or its text parts joined)."""
    for column, role_key, content_key in (("conversations", "from", "value"), ("messages", "role", "content")):
        if row.get(column) is not None:
            break
    out = []
    for turn in row[column]:
        value = turn.get(content_key) if isinstance(turn, dict) else None
        if isinstance(value, list):
            value = "".join(p["text"] for p in value if p.get("type") == "text")
        out.append((turn.get(role_key) if isinstance(turn, dict) else None, value))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines, st.floats(0.0, 0.9))
def test_pull_then_prep_never_crash_count_everything_and_keep_text(records, val_fraction):
    # each row names itself in `source`, so kept rows can be matched with their raw line
    records = [line if not line.startswith("{\"") else json.dumps({**json.loads(line), "source": f"line{i}"})
               for i, line in enumerate(records)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.jsonl"
        path.write_text("".join(line + "\n" for line in records), encoding="utf-8")
        try:
            manifest = pull_hermes3(str(path), Path(tmp) / "pulled.parquet")
        except AndreaError as err:
            assert "is a conversation in the Hermes-3" in str(err)
            return
        pulled = pq.read_table(Path(tmp) / "pulled.parquet").to_pylist()
    assert manifest["counts"]["rows_in"] == len(records) == len(pulled) + sum(manifest["dropped"].values())
    assert set(manifest["dropped"]) <= set(DROP_REASONS)
    raw = {f"line{i}": json.loads(line) for i, line in enumerate(records) if line.startswith("{\"")}
    for row in pulled:
        if row["source"] in raw:
            assert [t and t["value"] for t in row["conversations"]] == [v for _, v in raw_texts(raw[row["source"]])]

    drops, turn_drops = Drops(), Counter()
    kept = list(megachat_records(pulled, val_fraction, drops, turn_drops))
    assert len(kept) + drops.total == len(pulled)
    assert set(drops.counts) <= set(DROP_REASONS) and set(turn_drops) <= set(TURN_DROP_REASONS)
    for _, record in kept:
        expected = [(chatml_role(r), clean_text(v)) for r, v in raw_texts(raw[record["source"]])
                    if isinstance(r, str) and chatml_role(r) and isinstance(v, str) and clean_text(v)]
        assert [(t["role"], t["content"]) for t in record["turns"]] == expected
        assert all(t["weight"] in (0, 1) for t in record["turns"])
