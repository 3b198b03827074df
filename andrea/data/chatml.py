"""ChatML: the one implementation of how a conversation becomes text and token ids.

    <|im_start|>{role}\\n{content}<|im_end|>\\n      per turn; a document ends with <|endoftext|>

The structural tokens are inserted by id. Content is encoded with special tokens treated as
literal text, so a conversation that contains the string "<|im_start|>" cannot forge a turn.
Prep, train-tokenizer, tokenize, sampling and eval all go through this module.

Encoding is byte-level BPE on pre-split words. The split pattern is GPT-2's with its character
classes spelled out, so Python's `re` and the tokenizers library (Oniguruma) split alike: we
split here and look each word up in a cache, asking the tokenizer only for words not seen yet.
That gives the ids `tokenizer.json` gives, at about twice its speed per core.
"""

from __future__ import annotations

import json
import os
import re
from itertools import chain
from typing import Iterable, Mapping, Sequence

from andrea.errors import AndreaError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Unicode White_Space, and ASCII punctuation as ranges; everything else counts as a letter
_WHITESPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
               "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_PUNCTUATION = r"!-/:-@\[-`{-~"
SPLIT_PATTERN = (
    r"'(?:s|t|re|ve|m|ll|d)"
    rf"| ?[^{_WHITESPACE}0-9{_PUNCTUATION}]+"
    r"| ?[0-9]{1,3}"
    rf"| ?[{_PUNCTUATION}]+"
    rf"|[{_WHITESPACE}]+(?![^{_WHITESPACE}])"
    rf"|[{_WHITESPACE}]+"
)
WORD_CACHE_LIMIT = 1 << 20  # words; cleared when full, which bounds memory on large corpora

Turns = Sequence[Mapping[str, str]]  # [{"role": ..., "content": ...}, ...]


def render(turns: Turns) -> str:
    """The ChatML text of a conversation (what `decode(encode_conversation(turns))` gives back)."""
    return "".join(f"{IM_START}{t['role']}\n{t['content']}{IM_END}\n" for t in turns)


def pre_tokenizer():
    """The tokenizers pre-tokenizer every ANDREA tokenizer is trained with."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _pre_tokenizer_json(tokenizer) -> dict:
    return json.loads(tokenizer.to_str())["pre_tokenizer"]


class ChatTokenizer:
    """A byte-level BPE tokenizer made by `andrea train-tokenizer`, with ChatML structure on top."""

    def __init__(self, tokenizer, name: str = "tokenizer"):
        from tokenizers import Tokenizer, models

        reference = Tokenizer(models.BPE())
        reference.pre_tokenizer = pre_tokenizer()
        if _pre_tokenizer_json(tokenizer) != _pre_tokenizer_json(reference):
            raise AndreaError(f"{name}: its pre-tokenizer is not ANDREA's; retrain it with `andrea train-tokenizer`")
        ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        if None in ids:
            missing = ", ".join(t for t, i in zip(SPECIAL_TOKENS, ids) if i is None)
            raise AndreaError(f"{name}: lacks the special token(s) {missing}; retrain it with `andrea train-tokenizer`")
        self.tokenizer = tokenizer
        # match special tokens only where we insert them by id, never inside content
        self.tokenizer.encode_special_tokens = True
        self.endoftext_id, self.im_start_id, self.im_end_id = ids
        self._split = re.compile(SPLIT_PATTERN).findall
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

    def _conversation_words(self, turns: Turns) -> list[str]:
        words = []
        for turn in turns:
            words.append(IM_START)
            words += self._split(f"{turn['role']}\n{turn['content']}")
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

    def encode_prompt(self, turns: Turns) -> list[int]:
        """A conversation followed by an open assistant turn, for the model to complete."""
        return self.encode_conversation(turns) + [self.im_start_id] + self.encode_text("assistant\n")

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
