"""The chat schemas the data stages read, and the one normal form they produce.

    Hermes-3: {"conversations": [{"from": "system" | "human" | "gpt", "value": str}, ...]}
    OpenAI:   {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}

A row may use either (parquet files with both columns hold mixed rows). The normal form is a
list of (role, content) pairs with ChatML roles. Every way a row can fail has a reason key,
counted in the manifests: the drop reasons.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from typing import Mapping

# (column, role key, content key) of each schema, in the order a row is tried
SCHEMAS = (("conversations", "from", "value"), ("messages", "role", "content"))

# role as written in either schema -> ChatML role; "tool" is the Hermes function-calling turn
CHATML_ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant",
    "tool": "tool",
}
HERMES_ROLES = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}

DROP_REASONS = {
    "not_a_record": "the row is not a JSON object",
    "no_conversation": "neither a 'conversations' nor a 'messages' field",
    "conversation_not_a_list": "the conversation is not a list of turns",
    "empty_conversation": "the conversation has no turns",
    "turn_not_a_record": "a turn is not a JSON object",
    "role_missing": "a turn has no role (from/role) string",
    "content_not_text": "a turn's content (value/content) is missing or not text",
    "unknown_role": "a turn's role is not system/human/gpt/user/assistant/tool",
    "invalid_unicode": "text that is not valid Unicode (e.g. a lone surrogate)",
    "empty_turn": "a turn is empty after whitespace normalisation",
    "no_assistant_turn": "no assistant (gpt) turn to learn from",
    "duplicate": "same turns as an earlier row",
}


class Dropped(Exception):
    """A row that cannot become a conversation; `reason` is a key of DROP_REASONS."""

    def __init__(self, reason: str):
        assert reason in DROP_REASONS, reason
        super().__init__(reason)
        self.reason = reason


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    # OpenAI's multi-part content: keep it when every part is text
    if isinstance(content, list) and content and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise Dropped("content_not_text")


def read_turns(row) -> list[tuple[str, str]]:
    """(role, content) pairs of a row in either schema, roles as written; raises Dropped."""
    if not isinstance(row, Mapping):
        raise Dropped("not_a_record")
    for column, role_key, content_key in SCHEMAS:
        turns = row.get(column)
        if turns is not None:
            break
    else:
        raise Dropped("no_conversation")
    if not isinstance(turns, (list, tuple)):
        raise Dropped("conversation_not_a_list")
    if not turns:
        raise Dropped("empty_conversation")
    pairs = []
    for turn in turns:
        if not isinstance(turn, Mapping):
            raise Dropped("turn_not_a_record")
        role = turn.get(role_key)
        if not isinstance(role, str):
            raise Dropped("role_missing")
        pairs.append((role, _content_text(turn.get(content_key))))
    return pairs


def to_hermes(pairs: list[tuple[str, str]]) -> list[dict]:
    """Hermes-3 turns; known roles renamed to Hermes names, others kept as written for prep to judge."""
    if not all(_is_valid_unicode(role) and _is_valid_unicode(content) for role, content in pairs):
        raise Dropped("invalid_unicode")  # parquet strings are UTF-8: a lone surrogate cannot be stored
    return [{"from": HERMES_ROLES.get(CHATML_ROLES.get(role, ""), role), "value": content} for role, content in pairs]


_LINE_BREAKS = re.compile(r"\r\n?|[\x0b\x0c\x85\u2028\u2029]")
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")
_TRAILING_SPACE = re.compile(r"[ \t\u00a0\u3000]+$", re.MULTILINE)
_BLANK_RUN = re.compile(r"\n{3,}")


def clean_text(text: str) -> str:
    """NFC; one kind of line break; no control characters; no trailing spaces; at most one blank line
    in a row; no blank lines at either end. Leading spaces of the first line stay (code indentation)."""
    text = unicodedata.normalize("NFC", text)
    text = _LINE_BREAKS.sub("\n", text)
    text = _CONTROL.sub("", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_RUN.sub("\n\n", text)
    return text.strip("\n")


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def normalise_turns(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """ChatML roles and cleaned content; raises Dropped for what training cannot use."""
    turns = []
    for role, content in pairs:
        chat_role = CHATML_ROLES.get(role.strip().lower())
        if chat_role is None:
            raise Dropped("unknown_role")
        if not _is_valid_unicode(content):
            raise Dropped("invalid_unicode")
        content = clean_text(content)
        if not content:
            raise Dropped("empty_turn")
        turns.append((chat_role, content))
    if not any(role == "assistant" for role, _ in turns):
        raise Dropped("no_assistant_turn")
    return turns


def content_hash(turns: list[tuple[str, str]]) -> str:
    """sha256 over the turns alone (not the source): equal conversations from two sources collide."""
    return hashlib.sha256(json.dumps(turns, ensure_ascii=False).encode()).hexdigest()
