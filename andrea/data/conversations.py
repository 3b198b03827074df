"""The chat schemas the data stages read, the turn policy, and the one normal form they produce.

    Hermes-3: {"conversations": [{"from": "system" | "human" | "gpt", "value": str, "weight"?: 0 | 1}, ...]}
    OpenAI:   {"messages": [{"role": "system" | "user" | "assistant", "content": str | [parts]}, ...]}

A row may use either (parquet files with both columns hold mixed rows). The pull keeps each
turn's text exactly as given (`hermes_turns`); prep applies the turn policy (`megachat_turns`):
a turn training cannot use is removed and counted by reason, and only a row with nothing left to
learn from is dropped. Every reason is a key of DROP_REASONS (rows) or TURN_DROP_REASONS (turns),
counted in the manifests.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import unicodedata
from collections import Counter
from typing import Mapping

# (column, role key, content key) of each schema, in the order a row is tried
SCHEMAS = (("conversations", "from", "value"), ("messages", "role", "content"))

# role as written (case, spaces, '-' and ' ' vs '_' ignored) -> ChatML role
CHATML_ROLES = {
    "system": "system", "developer": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant",
    # function calling: the call and the tool's answer are tool turns (never assistant targets)
    "tool": "tool", "function_call": "tool", "function_response": "tool", "observation": "tool",
    "ipython": "tool",
}
OPENAI_TO_HERMES = {"user": "human", "assistant": "gpt"}  # the pull's only renaming
WEIGHTS = (0, 1)  # a turn's weight: 1 counts its tokens in the loss mask, 0 does not

DROP_REASONS = {
    "broken_json": "the record is not valid JSON (counted; the file is read on)",
    "integer_too_long": "the record holds an integer of more digits than Python converts (4,300 by default)",
    "not_a_record": "the row is not a JSON object",
    "no_conversation": "neither a 'conversations' nor a 'messages' field",
    "conversation_not_a_list": "the conversation is not a list of turns",
    "empty_conversation": "the conversation has no turns",
    "turn_not_a_record": "a turn is not a JSON object (nor null)",
    "role_not_text": "a turn's role (from/role) is neither a string nor null",
    "content_not_text": "a turn's content (value/content) is neither text, null, nor a list of content parts",
    "weight_not_a_number": "a turn's weight is neither a number nor null",
    "invalid_unicode": "text that is not valid Unicode (a lone surrogate, or bytes that are not UTF-8)",
    "bad_weight": "a turn's weight is not 0, 1 or missing",
    "no_assistant_turn": "no assistant (gpt) turn left to learn from",
    "duplicate": "same turns as an earlier row",
}
TURN_DROP_REASONS = {
    "turn_not_a_record": "the turn is null or not an object",
    "role_missing": "the turn has no role (from/role)",
    "unknown_role": "the role is none of those in CHATML_ROLES",
    "content_missing": "the turn has no content (value/content is missing or null)",
    "content_not_text": "the content is neither text nor content parts",
    "invalid_unicode": "the content is not valid Unicode",
    "empty_turn": "the content is empty after whitespace normalisation (e.g. an empty system prompt)",
}
# OpenAI content parts other than text are counted by type (never kept as JSON text)
PART_TYPES = ("image_url", "image", "input_image", "input_audio", "audio", "file", "video", "refusal")


class Dropped(Exception):
    """A row that cannot become a conversation; `reason` is a key of DROP_REASONS."""

    def __init__(self, reason: str):
        assert reason in DROP_REASONS, reason
        super().__init__(reason)
        self.reason = reason


def conversation_of(row) -> tuple[list, str, str]:
    """(turns, role key, content key) of a row in either schema; raises Dropped."""
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
    return turns, role_key, content_key


def content_text(content, parts: Counter) -> str | None:
    """A turn's text: a string as it is; OpenAI content parts as their text parts joined, every
    other part counted in `parts` by type; None stays None. Raises Dropped for anything else."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise Dropped("content_not_text")
    texts = []
    for part in content:
        if not isinstance(part, Mapping):
            raise Dropped("content_not_text")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise Dropped("content_not_text")
            texts.append(part["text"])
        else:
            parts[kind if kind in PART_TYPES else "other"] += 1
    return "".join(texts)


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def hermes_turns(row, parts: Counter) -> list[dict | None]:
    """The row's turns in the Hermes-3 schema ({from, value, weight}), text exactly as given.

    Only what the schema cannot hold drops the row: a turn that is not an object, a role, content
    or weight of another type, a weight no float holds, a lone surrogate. A missing role or content, or a null turn, is
    kept as null for prep to judge turn by turn. The OpenAI roles user and assistant get their
    Hermes names; every other role stays as written (prep maps roles)."""
    turns, role_key, content_key = conversation_of(row)
    out = []
    for turn in turns:
        if turn is None:
            out.append(None)
            continue
        if not isinstance(turn, Mapping):
            raise Dropped("turn_not_a_record")
        role = turn.get(role_key)
        if role is not None and not isinstance(role, str):
            raise Dropped("role_not_text")
        value = content_text(turn.get(content_key), parts)
        weight = _weight(turn.get("weight"))
        if not all(text is None or _is_valid_unicode(text) for text in (role, value)):
            raise Dropped("invalid_unicode")  # parquet strings are UTF-8: a lone surrogate cannot be stored
        out.append({"from": OPENAI_TO_HERMES.get(role, role), "value": value, "weight": weight})
    return out


def _weight(weight) -> float | None:
    """A turn's weight as the float the schema holds; raises Dropped for one of another type, or one
    no float holds (1e400, which the json module reads as infinity, an integer as large, NaN)."""
    if weight is None:
        return None
    if not isinstance(weight, (bool, int, float)):
        raise Dropped("weight_not_a_number")
    try:
        weight = float(weight)
    except OverflowError:
        raise Dropped("bad_weight") from None
    if not math.isfinite(weight):
        raise Dropped("bad_weight")
    return weight


def hermes_source(row) -> str | None:
    """The row's own `source` when it is non-empty text, else None; raises Dropped for text that is
    not valid Unicode, which parquet cannot store."""
    source = row.get("source") if isinstance(row, Mapping) else None
    if not isinstance(source, str) or not source:
        return None
    if not _is_valid_unicode(source):
        raise Dropped("invalid_unicode")
    return source


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


def chatml_role(role: str) -> str | None:
    return CHATML_ROLES.get(role.strip().lower().replace("-", "_").replace(" ", "_"))


def megachat_turns(row, turn_drops: Counter, parts: Counter) -> list[dict]:
    """The turn policy: ChatML turns {role, content, weight} of a row in either schema.

    A turn that training cannot use is removed and counted in `turn_drops` by reason (see
    TURN_DROP_REASONS); content parts other than text are counted in `parts`. The row is dropped
    (Dropped) only when it has no conversation, a weight that is not 0/1, or no assistant turn
    left. Counters are only added to for a row that is kept."""
    turns, role_key, content_key = conversation_of(row)
    if not turns:
        raise Dropped("empty_conversation")
    drops, row_parts, kept = Counter(), Counter(), []
    for turn in turns:
        if not isinstance(turn, Mapping):
            drops["turn_not_a_record"] += 1
            continue
        role = turn.get(role_key)
        if not isinstance(role, str):
            drops["role_missing"] += 1
            continue
        chat_role = chatml_role(role)
        if chat_role is None:
            drops["unknown_role"] += 1
            continue
        try:
            content = content_text(turn.get(content_key), row_parts)
        except Dropped:
            drops["content_not_text"] += 1
            continue
        if content is None:
            drops["content_missing"] += 1
            continue
        if not _is_valid_unicode(content):
            drops["invalid_unicode"] += 1
            continue
        content = clean_text(content)
        if not content:
            drops["empty_turn"] += 1
            continue
        weight = turn.get("weight")
        if weight is not None and weight not in WEIGHTS:
            raise Dropped("bad_weight")
        kept.append({"role": chat_role, "content": content, "weight": 1 if weight is None else int(weight)})
    if not any(t["role"] == "assistant" for t in kept):
        raise Dropped("no_assistant_turn")
    turn_drops.update(drops)
    parts.update(row_parts)
    return kept


def content_hash(turns: list[dict]) -> str:
    """sha256 over roles and contents alone (not the source, not the weights): equal conversations
    from two sources collide."""
    pairs = [(t["role"], t["content"]) for t in turns]
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()
