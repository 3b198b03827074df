"""train-tokenizer's bounds: the longest token, unspaced scripts split into short words, memory that
follows the distinct words rather than a paragraph's length, and the settings in the manifest."""

import json
import random
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from andrea.data.chatml import MAX_WORD_CHARS, SPECIAL_TOKENS, ChatTokenizer, split_pattern
from andrea.data.prep_megachat import MEGACHAT_SCHEMA
from andrea.data.train_tokenizer import train_tokenizer
from andrea.store.manifest import read_manifest


def megachat(path, contents):
    """A MegaChat train parquet with one user/assistant conversation per content."""
    rows = [{"id": str(i), "source": "test", "n_turns": 2, "text": "",
             "turns": [{"role": "user", "content": "Tell me.", "weight": 1},
                       {"role": "assistant", "content": c, "weight": 1}]} for i, c in enumerate(contents)]
    pq.write_table(pa.Table.from_pylist(rows, schema=MEGACHAT_SCHEMA), path)
    return path


def token_strings(tokenizer_json):
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    return [t for t in vocab if t not in SPECIAL_TOKENS]


@pytest.mark.parametrize("cap", [8, 16])
def test_no_token_is_longer_than_the_cap(tmp_path, cap):
    train = megachat(tmp_path / "train.parquet", ["A" * 200_000, "B" * 50_000 + " " * 70_000 + "=" * 9_000,
                                                  "hello world " * 2000])
    manifest = train_tokenizer(train, 1024, tmp_path / "tokenizer.json", max_token_length=cap)
    lengths = [len(t) for t in token_strings(tmp_path / "tokenizer.json")]
    assert cap // 2 < max(lengths) <= cap, "long runs merge up to the cap, never past it"
    assert manifest["config"]["max_token_length"] == cap
    chat = ChatTokenizer.load(tmp_path / "tokenizer.json")
    assert chat.decode(chat.encode_text("A" * 200_000)) == "A" * 200_000


def test_unspaced_scripts_split_into_short_words():
    split = re.compile(split_pattern(1)).findall
    text = "日本語のテキスト、中文文本。한국어텍스트ภาษาไทย"
    assert "".join(split(text)) == text and all(len(w) == 1 for w in split(text))
    words = re.compile(split_pattern(3)).findall("ABC" * 100 + "漢字" * 100)
    assert max(len(w) for w in words) == MAX_WORD_CHARS and words[-1] == "漢字"
    assert all(len(w) <= 3 for w in words if "漢" in w or "字" in w)
    assert split("mixed日本text") == ["mixed", "日", "本", "text"]


def test_a_tokenizer_with_another_chunk_encodes_as_tokenizer_json_does(tmp_path):
    rng = random.Random(1)
    chars = [chr(0x4E00 + rng.randrange(300)) for _ in range(300)]
    texts = ["".join(rng.choice(chars) for _ in range(400)) + " and English" for _ in range(50)]
    manifest = train_tokenizer(megachat(tmp_path / "train.parquet", texts), 2000, tmp_path / "tokenizer.json",
                               unspaced_chunk=3)
    assert manifest["config"]["unspaced_chunk"] == 3
    chat = ChatTokenizer.load(tmp_path / "tokenizer.json")
    assert chat.unspaced_chunk == 3
    assert any(len(t) > 3 for t in token_strings(tmp_path / "tokenizer.json") if not t.isascii()), \
        "words of three ideographs let BPE learn tokens longer than one (3-byte) character"
    for text in texts[:10]:
        assert chat.encode_text(text) == chat.tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.slow
def test_cjk_text_trains_in_bounded_memory(tmp_path):
    """8 MB of Chinese without spaces: as one word per paragraph this took 784 MB and 41 s; split
    into characters, what memory holds is the few thousand distinct words."""
    rng = random.Random(0)
    chars = [chr(0x4E00 + rng.randrange(3000)) for _ in range(3000)]
    texts, size = [], 0
    while size < 8e6:
        texts.append("".join(rng.choice(chars) for _ in range(rng.randrange(300, 3000))) + "。")
        size += len(texts[-1].encode())
    train = megachat(tmp_path / "train.parquet", texts)
    code = (f"from andrea.data.train_tokenizer import train_tokenizer; "
            f"train_tokenizer({str(train)!r}, 4096, {str(tmp_path / 'tokenizer.json')!r})")
    # The child's own peak, printed as it exits: VmHWM is its address space's. ru_maxrss (of the child or of
    # RUSAGE_CHILDREN) keeps the high-water mark from before its exec, i.e. this test process's own size.
    code += "; print(next(ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM:')))"
    run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=600)
    peak_mb = int(run.stdout.split()[-1]) / 1024
    assert peak_mb < 350, f"peak RSS {peak_mb:.0f} MB"
    assert read_manifest(tmp_path / "tokenizer.json")["counts"]["content_bytes"] > 8e6
