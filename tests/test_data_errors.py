"""Bad inputs to the data stages: exit code 2 and one sentence naming the file and the fix."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andrea.cli import main
from andrea.data.chatml import SPECIAL_TOKENS, pre_tokenizer


def oversized_tokenizer(path):
    """A tokenizer.json shaped like ours but with more tokens than a uint16 shard can hold."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    byte_vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizer()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.add_tokens([f"w{i}" for i in range(66_000)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def bad_inputs(tmp):
    """(argv, words the message must contain) for each way a user can get an input wrong."""
    (tmp / "other.json").write_text(json.dumps([{"prompt": "hi", "answer": "ho"}]))
    (tmp / "notes.txt").write_text("hello")
    (tmp / "megachat").mkdir()
    pq.write_table(pa.table({"text": ["hi"]}), tmp / "megachat" / "train.parquet")
    big = oversized_tokenizer(tmp / "big" / "tokenizer.json")
    return [
        (["pull-hermes3", "--source", str(tmp / "missing.jsonl")], ["missing.jsonl", "no such file"]),
        (["pull-hermes3", "--source", str(tmp / "other.json")], ["other.json", "'conversations'", "'messages'"]),
        (["pull-hermes3", "--source", str(tmp / "notes.txt")], ["notes.txt", ".jsonl"]),
        (["pull-hermes3", "--revision", "v1"], ["--revision", "--source hub"]),
        (["prep-megachat", "--in", str(tmp / "missing.parquet")], ["missing.parquet", "pull-hermes3"]),
        (["prep-megachat", "--in", str(tmp / "other.json")], ["other.json", "parquet"]),
        (["prep-megachat", "--in", str(tmp / "megachat" / "train.parquet")], ["'conversations'", "'messages'"]),
        (["prep-megachat", "--in", str(tmp / "x.parquet"), "--val-fraction", "1.5"], ["--val-fraction", "[0, 1)"]),
        (["train-tokenizer", "--vocab-size", "70000"], ["70,000", "65,536"]),
        (["train-tokenizer", "--in", str(tmp / "megachat" / "train.parquet")], ["turns", "prep-megachat"]),
        (["train-tokenizer", "--max-token-length", "100"], ["--max-token-length 100", "[1, 64]"]),
        (["train-tokenizer", "--unspaced-chunk", "0"], ["--unspaced-chunk 0", "[1, 16]"]),
        (["tokenize", "--tokenizer", str(big), "--out-dir", str(big.parent)], ["vocabulary size", "65,536"]),
        (["tokenize", "--tokenizer", str(big), "--out-dir", str(tmp / "elsewhere")], ["--tokenizer", "one folder"]),
        (["lineage", str(tmp / "notes.txt")], ["notes.txt", "no manifest"]),
    ]


N_CASES = 15


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    cases = bad_inputs(tmp_path_factory.mktemp("bad"))
    assert len(cases) == N_CASES
    return cases


@pytest.mark.parametrize("index", range(N_CASES))
def test_bad_input_gives_one_clear_sentence_and_exit_code_2(cases, index, capsys):
    argv, words = cases[index]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    message = err[-1]
    assert message.startswith(f"andrea {argv[0]}: error: ")
    assert sum("error" in line for line in err) == 1 and "Traceback" not in "\n".join(err)
    for word in words:
        assert word in message, (word, message)
