"""ChatML: the one implementation of how a conversation becomes text and token ids.

    <|im_start|>{role}\\n{content}<|im_end|>\\n      per turn; a document ends with <|endoftext|>

The structural tokens are inserted by id. Content is encoded with special tokens treated as
literal text, so a conversation that contains the string "<|im_start|>" cannot forge a turn.
Prep, train-tokenizer, tokenize, sampling and eval all go through this module.

Encoding is byte-level BPE on pre-split words. The split pattern is GPT-2's with its character
classes spelled out, so Python's `re` and the tokenizers library (Oniguruma) split alike, plus
one rule: scripts written without spaces (CJK, kana, Hangul, Thai, ...) split into words of at
most `unspaced_chunk` characters, so a paragraph of Chinese is not one "word" (which made BPE
training take gigabytes and learn nothing reusable). We split here and look each word up in a
cache, asking the tokenizer only for words not seen yet. That gives the ids `tokenizer.json`
gives, at about twice its speed per core.
"""

from __future__ import annotations

import json
import os
import re
from itertools import chain
from typing import Iterable, Mapping, Sequence

from andrea.common.errors import AndreaError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Unicode White_Space, and ASCII punctuation as ranges; everything else counts as a letter
_WHITESPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
               "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_PUNCTUATION = r"!-/:-@\[-`{-~"
# Scripts written without spaces between words, as character ranges (CJK ideographs with their
# radicals, strokes, symbols, compatibility and full-width forms; kana; Hangul; Thai, Lao, Myanmar,
# Khmer). U+3000 is white space and stays there.
_UNSPACED = ("\u0e00-\u0eff\u1000-\u109f\u1100-\u11ff\u1780-\u17ff\u2e80-\u2fff\u3001-\u303f"
             "\u3040-\u9fff\ua960-\ua97f\uac00-\ud7ff\uf900-\ufaff\ufe30-\ufe4f\uff00-\uffef"
             "\U0001b000-\U0001b16f\U00020000-\U000323af")
UNSPACED_CHUNK = 1  # default characters per word of an unspaced script: distinct words stay few
MAX_UNSPACED_CHUNK = 16
MAX_TOKEN_LENGTH = 16  # default longest token a tokenizer learns, in bytes
# Longest run of letters, punctuation or white space that is one word: BPE training time grows
# with the square of a word's length (200,000 'A's took 21 s), and no token can be this long.
MAX_WORD_CHARS = 64


def split_pattern(unspaced_chunk: int = UNSPACED_CHUNK) -> str:
    """The word-split regex: GPT-2's rules, with runs cut every MAX_WORD_CHARS characters, and
    runs of unspaced scripts every `unspaced_chunk`."""
    if not 1 <= unspaced_chunk <= MAX_UNSPACED_CHUNK:
        raise AndreaError(f"unspaced_chunk {unspaced_chunk} must lie in [1, {MAX_UNSPACED_CHUNK}]")
    run = f"{{1,{MAX_WORD_CHARS}}}"
    return (
        r"'(?:s|t|re|ve|m|ll|d)"
        rf"| ?[^{_WHITESPACE}0-9{_PUNCTUATION}{_UNSPACED}]{run}"
        rf"| ?[{_UNSPACED}]{{1,{unspaced_chunk}}}"
        r"| ?[0-9]{1,3}"
        rf"| ?[{_PUNCTUATION}]{run}"
        rf"|[{_WHITESPACE}]{run}(?![^{_WHITESPACE}])"
        rf"|[{_WHITESPACE}]{run}"
    )


WORD_CACHE_LIMIT = 1 << 20  # words; cleared when full, which bounds memory on large corpora

Turns = Sequence[Mapping[str, str]]  # [{"role": ..., "content": ...}, ...]


def render(turns: Turns) -> str:
    """The ChatML text of a conversation (what `decode(encode_conversation(turns))` gives back)."""
    return "".join(f"{IM_START}{t['role']}\n{t['content']}{IM_END}\n" for t in turns)


def pre_tokenizer(unspaced_chunk: int = UNSPACED_CHUNK):
    """The tokenizers pre-tokenizer an ANDREA tokenizer is trained with."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_pattern(unspaced_chunk)), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _pre_tokenizer_json(tokenizer) -> dict:
    return json.loads(tokenizer.to_str())["pre_tokenizer"]


def unspaced_chunk_of(tokenizer) -> int | None:
    """The `unspaced_chunk` an ANDREA pre-tokenizer was built with; None for any other pre-tokenizer."""
    from tokenizers import Tokenizer, models

    found = _pre_tokenizer_json(tokenizer)
    # candidates: the counted repeats in the pattern (one of them is the unspaced chunk)
    for chunk in sorted({int(n) for n in re.findall(r"\]\{1,(\d+)\}", json.dumps(found))}):
        if 1 <= chunk <= MAX_UNSPACED_CHUNK:
            reference = Tokenizer(models.BPE())
            reference.pre_tokenizer = pre_tokenizer(chunk)
            if _pre_tokenizer_json(reference) == found:
                return chunk
    return None


class ChatTokenizer:
    """A byte-level BPE tokenizer made by `andrea train-tokenizer`, with ChatML structure on top."""

    def __init__(self, tokenizer, name: str = "tokenizer"):
        self.unspaced_chunk = unspaced_chunk_of(tokenizer)
        if self.unspaced_chunk is None:
            raise AndreaError(f"{name}: its pre-tokenizer is not ANDREA's; retrain it with `andrea train-tokenizer`")
        ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        if None in ids:
            missing = ", ".join(t for t, i in zip(SPECIAL_TOKENS, ids) if i is None)
            raise AndreaError(f"{name}: lacks the special token(s) {missing}; retrain it with `andrea train-tokenizer`")
        self.tokenizer = tokenizer
        # match special tokens only where we insert them by id, never inside content
        self.tokenizer.encode_special_tokens = True
        self.endoftext_id, self.im_start_id, self.im_end_id = ids
        self._split = re.compile(split_pattern(self.unspaced_chunk)).findall
        self._word_ids: dict[str, list[int]] = {}
        self._forget_words()

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ChatTokenizer":
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise AndreaError(f"{path}: tokenizer not found; run `andrea train-tokenizer` first")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for unreadable files
            raise AndreaError(
                f"{path}: not a tokenizers JSON file ({err}); retrain it with `andrea train-tokenizer`"
            ) from None
        return cls(tokenizer, str(path))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> dict[str, int]:
        return dict(zip(SPECIAL_TOKENS, (self.endoftext_id, self.im_start_id, self.im_end_id)))

    def _forget_words(self) -> None:
        """Empty the word cache, keeping the structural tokens: they are cached under their own
        strings, which no split word can equal (a word never mixes letters and punctuation)."""
        self._word_ids.clear()
        self._word_ids.update({token: [i] for token, i in self.special_ids.items()})

    def _learn(self, words: Iterable[str]) -> None:
        """Cache the ids of the words not seen yet, asking the tokenizer in one batch."""
        words = set(words)
        unseen = words.difference(self._word_ids)
        if not unseen:
            return
        if len(self._word_ids) + len(unseen) > WORD_CACHE_LIMIT:
            self._forget_words()
            unseen = words.difference(self._word_ids)
        unseen = list(unseen)
        encoded = self.tokenizer.encode_batch_fast(unseen, add_special_tokens=False)
        self._word_ids.update(zip(unseen, (e.ids for e in encoded)))

    def _ids(self, words: list[str]) -> list[int]:
        return list(chain.from_iterable(map(self._word_ids.__getitem__, words)))

    def _turn_words(self, turn) -> tuple[list[str], list[str]]:
        """A turn's header words (<|im_start|>, the role, the newline) and content words. Header and
        content are split apart, so no word (hence no token) straddles the start of the content."""
        return [IM_START, *self._split(f"{turn['role']}\n")], self._split(turn["content"])

    def _conversation_words(self, turns: Turns) -> list[str]:
        words = []
        for turn in turns:
            header, content = self._turn_words(turn)
            words += header
            words += content
            words += (IM_END, "\n")
        return words

    def encode_text(self, text: str) -> list[int]:
        """Plain text to ids; special-token strings in it stay literal text."""
        words = self._split(text)
        self._learn(words)
        return self._ids(words)

    def encode_conversations(self, conversations: Iterable[Turns]) -> list[list[int]]:
        """Ids of each conversation (without <|endoftext|>), new words encoded as one batch."""
        words = [self._conversation_words(turns) for turns in conversations]
        self._learn(chain.from_iterable(words))
        return [self._ids(w) for w in words]

    def encode_conversation(self, turns: Turns) -> list[int]:
        return self.encode_conversations([turns])[0]

    def encode_documents(self, conversations: Iterable[Turns]) -> list[int]:
        """The token stream training reads: each conversation followed by <|endoftext|>."""
        words = []
        for turns in conversations:
            words += self._conversation_words(turns)
            words.append(ENDOFTEXT)
        self._learn(words)
        return self._ids(words)

    def encode_documents_masked(self, conversations: Iterable[Turns]) -> tuple[list[int], bytearray]:
        """`encode_documents` and its loss mask, one byte per token: the turn's weight (1 when it
        has none) for an assistant turn's content tokens and its <|im_end|>, 0 for everything else
        (system, user and tool turns, role headers, <|im_start|>, the newline after <|im_end|>,
        <|endoftext|>)."""
        words: list[str] = []
        runs: list[list[int]] = []  # [end in words, mask value], adjacent runs of one value merged

        def run(value: int) -> None:
            if runs and runs[-1][1] == value:
                runs[-1][0] = len(words)
            else:
                runs.append([len(words), value])

        for turns in conversations:
            for turn in turns:
                header, content = self._turn_words(turn)
                words += header
                if turn["role"] == "assistant":
                    run(0)
                    words += content
                    words.append(IM_END)
                    run(int(turn.get("weight", 1)))
                    words.append("\n")
                else:
                    words += content
                    words += (IM_END, "\n")
                run(0)
            words.append(ENDOFTEXT)
            run(0)
        self._learn(words)
        ids: list[int] = []
        mask = bytearray()
        start = 0
        for end, value in runs:
            part = self._ids(words[start:end])
            ids += part
            mask += bytes((value,)) * len(part)
            start = end
        return ids, mask

    def encode_prompt(self, turns: Turns) -> list[int]:
        """A conversation followed by an open assistant turn, for the model to complete."""
        return self.encode_conversation(turns) + [self.im_start_id] + self.encode_text("assistant\n")

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
