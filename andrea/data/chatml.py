"""ChatML: the one implementation of how a conversation becomes text and token ids.

    <|im_start|>{role}\\n{content}<|im_end|>\\n      per turn; a document ends with <|endoftext|>

The structural tokens are inserted by id. Content is encoded with special tokens treated as
literal text, so a conversation that contains the string "<|im_start|>" cannot forge a turn.
Prep, tokenize, sampling and eval all go through this module.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping, Sequence

from andrea.errors import AndreaError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

Turns = Sequence[Mapping[str, str]]  # [{"role": ..., "content": ...}, ...]


def render(turns: Turns) -> str:
    """The ChatML text of a conversation (what `decode(encode_conversation(turns))` gives back)."""
    return "".join(f"{IM_START}{t['role']}\n{t['content']}{IM_END}\n" for t in turns)


class ChatTokenizer:
    """A byte-level BPE tokenizer with ChatML structure on top."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # match special tokens only when we insert them by id, never inside content
        self.tokenizer.encode_special_tokens = True
        ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        if None in ids:
            missing = ", ".join(t for t, i in zip(SPECIAL_TOKENS, ids) if i is None)
            raise AndreaError(f"tokenizer lacks the special token(s) {missing}; train it with `andrea train-tokenizer`")
        self.endoftext_id, self.im_start_id, self.im_end_id = ids
        self._newline_ids = self.encode_text("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ChatTokenizer":
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise AndreaError(f"{path}: tokenizer not found; run `andrea train-tokenizer` first")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for unreadable files
            raise AndreaError(f"{path}: not a tokenizers JSON file ({err}); retrain it with `andrea train-tokenizer`") from None
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> dict[str, int]:
        return dict(zip(SPECIAL_TOKENS, (self.endoftext_id, self.im_start_id, self.im_end_id)))

    def encode_text(self, text: str) -> list[int]:
        """Plain text to ids; special-token strings in it stay literal text."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_conversations(self, conversations: Iterable[Turns]) -> list[list[int]]:
        """Ids of many conversations (no <|endoftext|>); one batched, multi-threaded encode call."""
        conversations = list(conversations)
        pieces = [f"{t['role']}\n{t['content']}" for turns in conversations for t in turns]
        encoded = iter(self.tokenizer.encode_batch_fast(pieces, add_special_tokens=False))
        start, end, newline = [self.im_start_id], [self.im_end_id], self._newline_ids
        result = []
        for turns in conversations:
            ids: list[int] = []
            for _ in turns:
                ids += start
                ids += next(encoded).ids
                ids += end
                ids += newline
            result.append(ids)
        return result

    def encode_conversation(self, turns: Turns) -> list[int]:
        return self.encode_conversations([turns])[0]

    def encode_prompt(self, turns: Turns) -> list[int]:
        """A conversation followed by an open assistant turn, for the model to complete."""
        return self.encode_conversation(turns) + [self.im_start_id] + self.encode_text("assistant\n")

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
