"""Rows of raw chat files, decoded exactly: JSON Lines, JSON arrays and parquet, also gzip'd.

Every reader yields `(number, row)` pairs: the line a JSON record starts on (1-based), or the
parquet row (1-based); `row` is the record as the json module decodes it (strings byte-for-byte
what the file holds), or `Unreadable(reason)` for a record that cannot be decoded. A bad record
is one pair; it never ends the file and never changes the rows around it.

Why not `datasets`: its JSON loader infers one Arrow type per field over a 10 MB chunk, so one
field of another type turns the whole chunk's text into quoted JSON (`on_mixed_types="use_json"`)
and one broken line fails the file. Here each record is decoded on its own.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import re
from dataclasses import dataclass
from typing import IO, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from andrea.data.tables import iter_batches

READ_BYTES = 1 << 20  # what one read of a JSON array asks for; the buffer grows for larger records
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
# an object's opening up to its first key, e.g. `{"conversations"`: valid JSON has this text only where
# an object opens (a quote inside a string is escaped), so it marks where the next element starts
_OPENER = re.compile(r'\{[ \t\n\r]*"(?:[^"\\\n]|\\.)*"')
MAX_OPENERS = 8  # the elements' distinct openings remembered; chat files have one or two


@dataclass(frozen=True)
class Unreadable:
    """A record that cannot be decoded: not valid JSON (nor its JSON-typed parquet value), an
    integer too long to convert, or text that is not UTF-8 in parquet; `reason` is a drop reason
    of the pull."""

    reason: str = "broken_json"


Rows = Iterator[tuple[int, object]]


def _text(raw: bytes) -> str:
    # invalid UTF-8 bytes become lone surrogates, which the pull then drops as invalid_unicode
    return raw.decode("utf-8", errors="surrogateescape")


def _decode_error(err: ValueError) -> Unreadable:
    # the json module raises a plain ValueError (no JSONDecodeError) only for an integer longer than
    # int() converts (sys.get_int_max_str_digits(), 4,300 digits by default)
    return Unreadable("broken_json" if isinstance(err, json.JSONDecodeError) else "integer_too_long")


def json_lines(stream: IO[bytes]) -> Rows:
    """One JSON value per line (blank lines skipped); split on b"\\n" only, so the Unicode line
    separators a JSON string may hold never cut a record."""
    for number, raw in enumerate(stream, 1):
        text = _text(raw)
        if number == 1:
            text = text.removeprefix("\ufeff")
        if not text.strip():
            continue
        try:
            yield number, json.loads(text)
        except ValueError as err:
            yield number, _decode_error(err)
        except RecursionError:
            yield number, Unreadable()


class _Buffer:
    """Decoded text of a stream read in line-aligned pieces, with the line number at `pos`."""

    def __init__(self, stream: IO[bytes]):
        self.stream = stream
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="surrogateescape")
        self.text = ""
        self.pos = 0
        self.line = 1
        self.eof = False

    def fill(self, at_least: int = READ_BYTES) -> bool:
        """Read on (at least `at_least` bytes, then to the end of that line); False at the end."""
        if self.eof:
            return False
        raw = self.stream.read(at_least)
        if raw and not raw.endswith(b"\n"):
            raw += self.stream.readline(16 * READ_BYTES)
        self.eof = not raw
        self.text = self.text[self.pos:] + self.decoder.decode(raw, final=self.eof)
        self.pos = 0
        return not self.eof

    def advance(self, end: int) -> None:
        self.line += self.text.count("\n", self.pos, end)
        self.pos = end

    def skip_whitespace(self) -> str:
        """The next character that is not whitespace, or "" at the end of the stream."""
        while True:
            self.advance(_WHITESPACE.match(self.text, self.pos).end())
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.fill():
                return ""

    def complete(self) -> bool:
        """The buffer ends at a line end: no JSON token (string, number, literal) is cut, since none
        may hold a raw newline; so an error before the end is in the text, not in the reading."""
        return self.eof or self.text.endswith("\n")


def _skip_broken(buf: _Buffer, indent: int | None, openers: set[str]) -> None:
    """Move past one broken array element, tolerantly: by brackets outside strings (a string also
    ends at a newline, which JSON forbids inside one), stopping at a ',' or ']' of the array, at a
    line that opens a new element at the elements' indentation, or at the opening of an element
    (`openers`, and this element's own), wherever it is: on one line, a lost '}' or '"' leaves the
    brackets or strings wrong to the end of the array. An object element that closes early (a lost
    '[' or '{') goes on to the next object or the array's end: what comes between is its rest."""
    opener = None if indent is None else "\n" + " " * indent + "{"
    own = _OPENER.match(buf.text, buf.pos)
    openers = tuple(openers | {own.group()}) if own else tuple(openers)
    while True:
        _skip_brackets(buf, opener, openers)
        if not own or _next_element(buf) in ("", "{", "]"):
            return


def _skip_brackets(buf: _Buffer, opener: str | None, openers: tuple[str, ...]) -> None:
    """One pass of `_skip_broken`: to the end of the brackets, an indented opening line (`opener`)
    or an element's opening (`openers`)."""
    depth, in_string, i = 0, False, buf.pos
    longest = max([len(opener or " "), *map(len, openers)])
    while True:
        if i + longest >= len(buf.text) and not buf.eof:
            start = buf.pos
            buf.fill()
            i -= start  # fill drops the text before pos
            continue
        if i >= len(buf.text):
            break
        c = buf.text[i]
        if c == "{" and i > buf.pos and buf.text.startswith(openers, i):
            break
        if in_string:
            if c == "\\":
                i += 2
                continue
            in_string = c not in '"\n'
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0:
                break
            depth -= 1
            if depth == 0:
                i += 1
                break
        elif c == "," and depth == 0:
            break
        if opener and c == "\n" and i > buf.pos and buf.text.startswith(opener, i):
            i += 1
            break
        i += 1
    # at least one character: a stray '}' must not be met again
    buf.advance(min(max(i, buf.pos + 1), len(buf.text)))


def _next_element(buf: _Buffer) -> str:
    """The first character of the array's next element, or ']', or "" at the end of the stream;
    moves past whitespace and commas."""
    while (c := buf.skip_whitespace()) == ",":
        buf.advance(buf.pos + 1)
    return c


def json_array(stream: IO[bytes]) -> Rows:
    """The elements of a top-level JSON array, streamed: memory holds one element at a time.
    Commas are separators only (a missing or trailing one loses nothing); a ']' followed by a comma
    is stray, not the array's end."""
    buf = _Buffer(stream)
    if buf.skip_whitespace() != "[":
        yield buf.line, Unreadable()
        return
    buf.advance(buf.pos + 1)
    indent = -1  # of the elements' opening lines; None when they do not start lines
    openers: set[str] = set()  # how the decoded elements open, e.g. `{"conversations"`
    while True:
        c = buf.skip_whitespace()
        if c == "":  # the array never closes: the file is cut short (a cut element was counted)
            return
        if c == "]":
            line = buf.line
            buf.advance(buf.pos + 1)
            if buf.skip_whitespace() != ",":
                break
            yield line, Unreadable()  # a stray ']' with elements after it: they are read on
            continue
        if c == ",":
            buf.advance(buf.pos + 1)
            continue
        if indent == -1:
            line_start = buf.text.rfind("\n", 0, buf.pos) + 1
            leading = buf.text[line_start:buf.pos]
            indent = len(leading) if line_start and not leading.strip(" ") else None
        line = buf.line
        while True:
            try:
                row, end = _DECODER.raw_decode(buf.text, buf.pos)
            except json.JSONDecodeError as err:
                if not buf.eof and (err.pos >= len(buf.text) or not buf.complete()):
                    buf.fill(max(READ_BYTES, len(buf.text) - buf.pos))  # doubling: long elements parse in O(n)
                    continue
                yield line, Unreadable()
                _skip_broken(buf, indent, openers)
            except ValueError as err:  # valid JSON, but an integer too long to convert
                yield line, _decode_error(err)
                _skip_broken(buf, indent, openers)
            except RecursionError:
                yield line, Unreadable()
                _skip_broken(buf, indent, openers)
            else:
                if len(openers) < MAX_OPENERS and (opening := _OPENER.match(buf.text, buf.pos)):
                    openers.add(opening.group())
                buf.advance(end)
                yield line, row
            break
    if buf.skip_whitespace():  # text after the array's end
        yield buf.line, Unreadable()


def json_records(stream: IO[bytes]) -> Rows:
    """A .json file: a top-level array, or else JSON Lines."""
    if not hasattr(stream, "peek"):
        stream = io.BufferedReader(stream)
    head = stream.peek(64)
    if head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        return json_array(stream)
    return json_lines(stream)


# ---- parquet ---------------------------------------------------------------------------------

def _json_leaf(feature, arrow_type: pa.DataType) -> bool:
    if isinstance(arrow_type, pa.ExtensionType) and arrow_type.extension_name == "arrow.json":
        return True
    return isinstance(feature, dict) and feature.get("_type") == "Json"


def _decoder(arrow_type: pa.DataType, feature) -> Callable | None:
    """A function that decodes the JSON-typed values inside a value of this type (datasets stores
    mixed-type fields as JSON text, typed `arrow.json` or marked Json in its features metadata);
    None when the type holds none."""
    if _json_leaf(feature, arrow_type):
        return lambda value: value if value is None else json.loads(value)
    if pa.types.is_struct(arrow_type):
        fields = {}
        for f in arrow_type:
            sub = feature.get(f.name) if isinstance(feature, dict) else None
            decode = _decoder(f.type, sub)
            if decode:
                fields[f.name] = decode
        if not fields:
            return None
        return lambda value: value if value is None else {
            k: (fields[k](v) if k in fields else v) for k, v in value.items()}
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        sub = None
        if isinstance(feature, dict):
            sub = feature.get("feature")
        elif isinstance(feature, list) and feature:
            sub = feature[0]
        decode = _decoder(arrow_type.value_type, sub)
        if not decode:
            return None
        return lambda value: value if value is None else [decode(v) for v in value]
    return None


def _features(schema: pa.Schema) -> dict:
    try:
        return json.loads(schema.metadata[b"huggingface"])["info"]["features"]
    except (TypeError, KeyError, ValueError):
        return {}


def parquet_rows(source) -> Rows:
    """Rows of a parquet file, a batch at a time, every value decoded to Python (JSON-typed ones
    with the json module, so mixed-type fields come back as the values they were)."""
    table = pq.ParquetFile(source)
    features = _features(table.schema_arrow)
    decoders = {f.name: d for f in table.schema_arrow
                if (d := _decoder(f.type, features.get(f.name)))}
    number = 0
    for batch in iter_batches(table):
        for row in _pylist(batch):
            number += 1
            if isinstance(row, Unreadable):
                yield number, row
                continue
            try:
                for name, decode in decoders.items():
                    row[name] = decode(row[name])
            except ValueError as err:
                yield number, _decode_error(err)
                continue
            except (TypeError, RecursionError):
                yield number, Unreadable()
                continue
            yield number, row


def _pylist(batch: pa.RecordBatch) -> list:
    """The batch's rows as Python values; a row whose string bytes are not UTF-8 (which pyarrow
    does not check when reading) is Unreadable, and the rest of the batch is kept."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        pass
    rows = []
    for i in range(batch.num_rows):
        try:
            rows.append(batch.slice(i, 1).to_pylist()[0])
        except UnicodeDecodeError:
            rows.append(Unreadable("invalid_unicode"))
    return rows


def open_stream(file: IO[bytes], name: str) -> IO[bytes]:
    """A buffered binary stream of an open file, gunzipped when its name ends in .gz."""
    return gzip.GzipFile(fileobj=file, mode="rb") if name.lower().endswith(".gz") else file
