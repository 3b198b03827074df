"""Loss masks: tokenize writes one mask byte per token; decoded, the tokens it marks are exactly the
assistant turns' contents, each followed by its <|im_end|>, for the turns of weight 1."""

import json

import numpy as np
import pytest
from conftest import data_stages

from andrea.data.chatml import IM_END, ChatTokenizer
from andrea.common.errors import AndreaError
from andrea.store.manifest import lineage, lineage_ok, read_manifest
from andrea.store.shards import HEADER_INTS, MASK_MAGIC, mask_path, mask_writer, read_mask, read_shard, write_shard

ROWS = [
    {"conversations": [{"from": "system", "value": "You are terse."}, {"from": "human", "value": "Hi there"},
                       {"from": "gpt", "value": "Hello."}]},
    {"conversations": [{"from": "human", "value": "Q1", "weight": 0}, {"from": "gpt", "value": "   indented answer", "weight": 0},
                       {"from": "human", "value": "Q2", "weight": 0}, {"from": "gpt", "value": "second answer", "weight": 1}]},
    {"messages": [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": "Let me call a tool."},
                  {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42 <|im_end|> literally."}]},
    {"conversations": [{"from": "human", "value": "日本語で?"}, {"from": "gpt", "value": "はい、日本語です。\n\n  code:\n    x = 1"}]},
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("masks")
    rows = [{**r, "source": f"r{i}-{k}"} for k in range(30) for i, r in enumerate(ROWS)]
    # vary the text so that dedup keeps every copy and the tokenizer has something to learn
    for row in rows:
        turns = row.get("conversations") or row["messages"]
        key = "value" if "conversations" in row else "content"
        turns[-1] = {**turns[-1], key: f"{turns[-1][key]} ({row['source']})"}
    (root / "chats.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    data_stages(root, root / "chats.jsonl", 400, val_fraction=0.2)
    return root


def expected_targets(turns):
    return [t["content"] + IM_END for t in turns if t["role"] == "assistant" and t["weight"] == 1]


@pytest.mark.parametrize("split", ["train", "val"])
def test_masked_tokens_decode_to_exactly_the_assistant_spans(shards, split):
    import pyarrow.parquet as pq

    chat = ChatTokenizer.load(shards / "tokens" / "tokenizer.json")
    tokens = np.asarray(read_shard(shards / "tokens" / f"{split}.bin"))
    mask = np.asarray(read_mask(mask_path(shards / "tokens" / f"{split}.bin"), tokens.size))
    assert set(np.unique(mask)) <= {0, 1}
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    spans = [chat.decode(tokens[a:b]) for a, b in zip(edges[::2], edges[1::2])]
    conversations = pq.read_table(shards / "megachat" / f"{split}.parquet").column("turns").to_pylist()
    assert conversations, "the split has conversations"
    assert spans == [target for turns in conversations for target in expected_targets(turns)]
    structural = np.isin(tokens, [chat.endoftext_id, chat.im_start_id])
    assert not mask[structural].any()
    # each span ends with the assistant's own <|im_end|> token; a literal "<|im_end|>" in content is text
    assert all(tokens[b - 1] == chat.im_end_id and chat.im_end_id not in tokens[a:b - 1]
               for a, b in zip(edges[::2], edges[1::2]))


def test_mask_files_have_their_own_header_and_manifest(shards):
    shard = shards / "tokens" / "train.bin"
    mask = mask_path(shard)
    assert mask.name == "train.mask.bin"
    header = np.fromfile(mask, dtype="<i4", count=HEADER_INTS)
    tokens = read_shard(shard)
    assert header[:3].tolist() == [MASK_MAGIC, 1, tokens.size]
    assert mask.stat().st_size == 4 * HEADER_INTS + tokens.size
    manifest = read_manifest(mask)
    assert manifest["stage"] == "tokenize" and manifest["counts"]["tokens"] == tokens.size
    assert 0 < manifest["counts"]["target_tokens"] == int(np.count_nonzero(read_mask(mask))) < tokens.size
    assert lineage_ok(lineage(mask))


def test_masks_refuse_what_is_not_a_mask(tmp_path):
    write_shard(tmp_path / "train.bin", np.arange(10))
    with pytest.raises(AndreaError, match=r"train\.bin: not a loss mask \(magic 20240520"):
        read_mask(tmp_path / "train.bin")
    with mask_writer(tmp_path / "train.mask.bin") as append:
        append(np.ones(9, dtype=np.uint8))
    with pytest.raises(AndreaError, match="9 mask values for a shard of 10 tokens"):
        read_mask(tmp_path / "train.mask.bin", tokens=10)
    with pytest.raises(AndreaError, match=r"mask values must lie in \[0, 2\)"):
        with mask_writer(tmp_path / "bad.mask.bin") as append:
            append(np.array([0, 1, 2]))
    assert not (tmp_path / "bad.mask.bin").exists()
