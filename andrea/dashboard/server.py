"""The dashboard server: the page and the run files under a results folder, read-only.

Routes (GET and HEAD only; every other method gets 405 with `Allow: GET, HEAD`):
    /                  the page (static/index.html); other paths are files of static/
    /api/runs          every NAME.loss.json under the results folder (once, however many hard links or
                       symlinks inside reach it), with size, age, state summary, current phase and best step,
                       whether it is current (not a run `andrea runs --prune` would remove) and its samples file
    /results/REL       a .json file under the results folder; `Range: bytes=N-` returns only
                       what was appended since byte N, so a poll of a long run sends kilobytes, not megabytes

Safe by default: binds loopback unless --allow-remote; a path with `..`, an absolute path or a symlink
that resolves outside the served folder gets 403; a Host header other than a loopback name gets 403
(so a web page cannot reach the server by DNS rebinding), one that cannot be parsed 400; a request
whose line and headers take longer than REQUEST_DEADLINE_S to arrive gets 408 and loses its connection.
"""

from __future__ import annotations

import io
import ipaddress
import json
import os
import re
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from andrea.common.errors import AndreaError
from andrea.store.runfiles import MAX_RECORD_BYTES, loads_record
from andrea.tools.runs import survey

STATIC = Path(__file__).resolve().parent / "static"
LOSS_SUFFIX = ".loss.json"
STATE_SUFFIX = ".state.json"
SAMPLES_SUFFIX = ".samples.json"
# Which runs are superseded (andrea.tools.runs.survey: it probes each run's lock) is asked at most this often.
SURVEY_TTL_S = 5.0
ALLOWED_METHODS = ("GET", "HEAD")
# A connection that sends no request (or stops reading a response) for this long is closed: the page
# polls every two seconds, so only abandoned connections reach it.
IDLE_TIMEOUT_S = 30.0
# From its first byte, a request's line and headers must arrive within this long, or it gets 408 and the
# connection is closed: a client trickling a byte at a time is never idle, yet must not hold a thread.
REQUEST_DEADLINE_S = 10.0
# A loss file is digested in pieces of at most this many bytes (the first listing reads it whole).
DIGEST_CHUNK = 1 << 22
# The tokens a backward pass over a line stops at: a bracket, or a quote with the backslashes before it
# (the line is reversed, so they follow it).
JSON_TOKENS = re.compile(rb'[][{}]|"\\*')
# JSON's whitespace, which may end a line after its record.
JSON_SPACE = b" \t\r\n"
# ASCII digits only: str.isdigit() takes '²' (which int() refuses), int() takes '٣' and '5_0'.
BYTE_RANGE = re.compile(r"([0-9]*)-([0-9]*)")
LOOPBACK_NAMES = {"localhost", "localhost.localdomain"}
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".json": "application/json; charset=utf-8"}


class Refused(Exception):
    def __init__(self, status: HTTPStatus, reason: str, headers: dict | None = None):
        super().__init__(reason)
        self.status = status
        self.headers = headers or {}


def inside(root: str, path: str) -> str | None:
    """The real path of `path` if it resolves under the real folder `root`."""
    real = os.path.realpath(path)
    return real if os.path.commonpath([root, real]) == root else None


def resolve_under(root: str, rel: str) -> str:
    """The real path of the file `rel` (URL-encoded, relative) under the real folder `root`."""
    rel = unquote(rel)
    if "\x00" in rel or "\\" in rel or rel.startswith("/") or ".." in rel.split("/"):
        raise Refused(HTTPStatus.FORBIDDEN, "path escapes the served folder")
    full = inside(root, os.path.join(root, rel))
    if full is None:
        raise Refused(HTTPStatus.FORBIDDEN, "path resolves outside the served folder")
    if not os.path.isfile(full):
        raise Refused(HTTPStatus.NOT_FOUND, "no such file")
    return full


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) byte of a single range: `bytes=N-`, `bytes=N-M` or `bytes=-N` (the last N bytes).
    None means send everything: no Range, another unit, or several ranges (RFC 9110 lets a server
    ignore those). A malformed range is refused with 400, one that selects no byte with 416."""
    if not header:
        return None
    unit, equals, spec = header.strip().partition("=")
    if equals and (unit.lower() != "bytes" or "," in spec):
        return None
    match = BYTE_RANGE.fullmatch(spec) if equals else None
    if not match or not any(match.groups()):
        raise Refused(HTTPStatus.BAD_REQUEST, "malformed Range header; expected bytes=FIRST-, bytes=FIRST-LAST "
                      "or bytes=-LENGTH in ASCII digits")
    first, last = match.groups()
    if first:
        first_i, last_i = byte_position(first, size), byte_position(last, size) if last else size - 1
    else:
        first_i, last_i = size - byte_position(last, size), size - 1
    if first_i >= size or last_i < first_i:
        raise Refused(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, "nothing in this range",
                      {"Content-Range": f"bytes */{size}"})
    return first_i, min(last_i, size - 1)


def byte_position(digits: str, size: int) -> int:
    """ASCII digits as a byte position, capped at `size` (int() refuses 4,300 digits and more)."""
    digits = digits.lstrip("0")
    return size if len(digits) > len(str(size)) else min(int(digits or "0"), size)


def read_state(path: str) -> dict | None:
    """The summary of a .state.json; None for one that is unreadable or not a JSON object."""
    try:
        with open(path, "rb") as f:
            state = loads_record(f.read(MAX_RECORD_BYTES + 1))  # longer is no state file
    except OSError:
        return None
    if state is None:
        return None
    experiment = state.get("experiment")
    return {"step": state.get("step"), "total_steps": state.get("total_steps"),
            "experiment": experiment.get("name") if isinstance(experiment, dict) else None}


def parse_record(line: bytes) -> dict | None:
    """The JSON object on a whole line, or None, as the page reads it: a line that is not one (`null`,
    a number, an array, a line torn by a full disk, one longer than MAX_RECORD_BYTES) is passed over,
    and a record that the next append glued onto a torn line is the part from one of its "{" to the
    end that parses. Only the "{" that the line's last "}" closes can be that one (from any other,
    the object ends before the line does), so one pass backwards finds it and one parse reads it."""
    rec = loads_record(line)
    if rec is not None or len(line) > MAX_RECORD_BYTES:
        return rec
    start = glued_record_start(line)
    return loads_record(line[start:]) if start else None


def glued_record_start(line: bytes) -> int | None:
    """Where the "{" is that the last "}" of `line` closes, counting brackets outside strings from the
    end; None if the line ends otherwise, if that bracket is missing or not a "{", or if it lies deeper
    than json.loads goes."""
    end = len(line.rstrip(JSON_SPACE))
    if not line[:end].endswith(b"}"):
        return None
    depth, quoted, limit = 0, False, sys.getrecursionlimit()
    for token in JSON_TOKENS.finditer(line[:end][::-1]):
        mark = token.group()
        if mark[0] == ord('"'):
            quoted ^= len(mark) % 2 == 1  # an even number of backslashes before it: it opens or ends a string
        elif not quoted:
            depth += 1 if mark in b"}]" else -1
            if depth > limit:
                return None
            if depth == 0:
                return end - 1 - token.start() if mark == b"{" else None
    return None


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


class LossDigest:
    """What the runs table shows of a loss file without the page reading it: the phase training is in
    (that of the newest step record, or the one a pivot event written after it starts; None for a run
    without phases) and the newest `best` event. Each listing reads only the bytes appended since the
    last one, and of those parses only the event lines it needs and the newest step record. A line
    longer than a record can be is passed over as it arrives: at most MAX_RECORD_BYTES of it is kept."""

    def __init__(self, file_id: tuple[int, int]):
        self.file_id = file_id
        self.lock = threading.Lock()
        self.start_over()

    def start_over(self) -> None:
        self.offset = 0
        self.tail = b""
        self.overlong = False  # in a line longer than MAX_RECORD_BYTES: the bytes up to its newline are dropped
        self.phase: str | None = None
        self.best: dict | None = None

    def update(self, path: str, size: int) -> None:
        """Read `path` up to byte `size` (what the listing's stat saw)."""
        with self.lock:
            if size < self.offset:  # rewritten in place
                self.start_over()
            if size == self.offset:
                return
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    if (st.st_dev, st.st_ino) != self.file_id:  # replaced since it was listed
                        return
                    f.seek(self.offset)
                    while self.offset < size:
                        chunk = f.read(min(size - self.offset, DIGEST_CHUNK))
                        if not chunk:
                            break
                        self.offset += len(chunk)
                        self._digest(chunk)
            except OSError:  # moved aside or unreadable since it was listed: keep what was read
                pass

    def _digest(self, chunk: bytes) -> None:
        if self.overlong:
            cut = chunk.find(b"\n")
            if cut < 0:
                return
            chunk, self.overlong = chunk[cut + 1:], False
        buf = self.tail + chunk
        end = buf.rfind(b"\n") + 1  # whole lines only: the trainer may be mid-write
        self.tail, body = buf[end:], buf[:end]
        if len(self.tail) > MAX_RECORD_BYTES:
            self.tail, self.overlong = b"", True
        for rec in records_backwards(body, b'"best"'):  # the newest best event
            if rec.get("event") == "best" and is_number(rec.get("step")):
                self.best = {"step": rec["step"],
                             "val_loss": rec["val_loss"] if is_number(rec.get("val_loss")) else None,
                             "metric": rec["metric"] if isinstance(rec.get("metric"), str) else None}
                break
        for rec in records_backwards(body, b"\n"):  # the newest step record or pivot
            if rec.get("event") == "pivot" and isinstance(rec.get("to"), str):
                self.phase = rec["to"]
                break
            if not rec.get("event") and is_number(rec.get("step")):
                self.phase = rec["phase"] if isinstance(rec.get("phase"), str) else None
                break


def records_backwards(body: bytes, needle: bytes):
    """The records of the whole lines in `body` that hold `needle` (b"\\n": every line), newest first,
    without splitting the rest: a first read of a long run is megabytes of lines nobody needs."""
    pos = len(body)
    while (pos := body.rfind(needle, 0, pos)) >= 0:
        start = body.rfind(b"\n", 0, pos) + 1
        stop = body.find(b"\n", pos)
        if stop < 0:
            stop = len(body)
        rec = parse_record(body[start:stop]) if b"{" in body[start:stop] else None
        if rec is not None:
            yield rec
        pos = start


def path_rank(rel: str) -> tuple[int, str]:
    """Fewest folders down first, then by name: the order runs are listed and copies are chosen in."""
    return rel.count("/"), rel


def superseded_files(root: str) -> set[tuple[int, int]]:
    """(device, inode) of the loss files of the runs `andrea runs --prune` would remove: a run folder that
    results/ does not link to, that is not running, and that a newer results/NAME.* supersedes."""
    found = set()
    try:
        runs = survey(root, sizes=False)["runs"]
    except (OSError, AndreaError):  # a folder unreadable or gone meanwhile: every run counts as current
        return found
    for run in runs:
        if run["prune"]:
            try:
                st = os.stat(run["files"].loss)
            except OSError:
                continue
            found.add((st.st_dev, st.st_ino))
    return found


def samples_of(root: str, paths: list[str]) -> dict | None:
    """NAME.samples.json beside the first of `paths` (relative loss files, fewest folders down first) that has
    one: the workflow hard-links a run's loss history into the results folder, not its samples."""
    for rel in paths:
        rel_samples = rel[: -len(LOSS_SUFFIX)] + SAMPLES_SUFFIX
        real = inside(root, os.path.join(root, rel_samples))
        try:
            st = os.stat(real) if real else None
        except OSError:
            continue
        if st is not None and os.path.isfile(real):
            return {"path": rel_samples, "size": st.st_size, "file_id": f"{st.st_dev}:{st.st_ino}"}
    return None


def run_summaries(root: str, digests: dict | None = None, superseded: set | None = None) -> list[dict]:
    """Every NAME.loss.json under `root` that resolves inside it, with what the page's header needs.
    A file reached by several paths is listed once, under the path fewest folders down: the workflow
    trains in runs/NAME/KEY/ and hard-links the finished files into the results folder. `digests`
    (file id -> LossDigest) keeps what was read of each file from one listing to the next; `superseded`
    (file ids, superseded_files) says which are not current."""
    digests = {} if digests is None else digests
    superseded = superseded_files(root) if superseded is None else superseded
    found: dict[tuple[int, int], tuple[str, os.stat_result]] = {}
    reached: dict[tuple[int, int], list[str]] = {}
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in files:
            if not name.endswith(LOSS_SUFFIX):
                continue
            path = os.path.join(folder, name)
            real = inside(root, path)
            if real is None:
                continue
            try:
                st = os.stat(real)
            except FileNotFoundError:  # moved aside (a fresh start) since the folder was listed
                continue
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            reached.setdefault((st.st_dev, st.st_ino), []).append(rel)
            kept = found.get((st.st_dev, st.st_ino))
            if kept is None or path_rank(rel) < path_rank(kept[0]):
                found[st.st_dev, st.st_ino] = rel, st
    for gone in set(digests) - set(found):  # moved aside or deleted
        digests.pop(gone, None)
    runs = []
    for key, (rel, st) in sorted(found.items(), key=lambda f: path_rank(f[1][0])):
        state = inside(root, os.path.join(root, rel[: -len(LOSS_SUFFIX)] + STATE_SUFFIX))
        digest = digests.get(key) or digests.setdefault(key, LossDigest(key))
        digest.update(os.path.join(root, rel), st.st_size)
        runs.append({
            "id": rel[: -len(LOSS_SUFFIX)],
            "loss": rel,
            "size": st.st_size,
            "file_id": f"{st.st_dev}:{st.st_ino}",
            "age_s": round(time.time() - st.st_mtime, 3),
            "state": read_state(state) if state else None,
            "phase": digest.phase,
            "best": digest.best,
            "current": key not in superseded,
            "samples": samples_of(root, sorted(reached[key], key=path_rank)),
        })
    return runs


class RequestTooSlow(Exception):
    """A request whose line and headers did not all arrive by its deadline."""


class ConnectionReader(io.RawIOBase):
    """The connection's bytes for the handler's rfile: between requests each read waits up to the idle
    timeout; while `deadline` is set (a request's line and headers are arriving) no read goes past it."""

    def __init__(self, sock: socket.socket, idle_timeout: float):
        self.sock = sock
        self.idle_timeout = idle_timeout
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self.deadline is None:
            return self.sock.recv_into(buf)
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestTooSlow()
        self.sock.settimeout(min(left, self.idle_timeout))
        try:
            return self.sock.recv_into(buf)
        except TimeoutError:
            if time.monotonic() >= self.deadline:
                raise RequestTooSlow() from None
            raise
        finally:
            self.sock.settimeout(self.idle_timeout)


class Handler(BaseHTTPRequestHandler):
    server_version = "andrea-dashboard"
    protocol_version = "HTTP/1.1"  # keep-alive: the page polls the same host every few seconds
    server: DashboardServer

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout  # StreamRequestHandler.setup puts it on the socket
        super().setup()
        self.rfile.close()  # the socket's own reader, which knows no deadline
        self.reader = ConnectionReader(self.connection, self.server.idle_timeout)
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self) -> None:
        """The standard library's, with a deadline from the request's first byte to its last header."""
        try:
            waiting = self.rfile.peek(1)  # empty: the client closed the connection
        except (TimeoutError, ConnectionError):  # idle (a kept-alive connection nobody uses any more), or reset
            waiting = b""
        if not waiting:
            self.close_connection = True
            return
        self.requestline = "(request line incomplete)"  # until parse_request reads it
        self.reader.deadline = time.monotonic() + REQUEST_DEADLINE_S
        try:
            super().handle_one_request()
        except RequestTooSlow:
            self.close_connection = True
            self.command, self.request_version = None, self.protocol_version
            try:
                self._error(Refused(HTTPStatus.REQUEST_TIMEOUT, "the request took too long to arrive",
                                    {"Connection": "close"}))
            except OSError:  # the client is gone too
                pass
        finally:
            self.reader.deadline = None

    def parse_request(self) -> bool:
        """The standard library's parsing, then 405 for every method but GET and HEAD (it would
        answer 501 to one it finds no do_METHOD for)."""
        parsed = super().parse_request()
        self.reader.deadline = None  # the headers are in: the reply is written under the idle timeout
        if not parsed:
            return False
        if self.command in ALLOWED_METHODS:
            return True
        self.close_connection = True  # its body is left unread, so the connection cannot carry another request
        self._error(Refused(HTTPStatus.METHOD_NOT_ALLOWED, "the dashboard is read-only",
                            {"Allow": ", ".join(ALLOWED_METHODS)}))
        return False

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def _serve(self, send_body: bool) -> None:
        try:
            self._check_host()
            path = self.path.split("?", 1)[0].split("#", 1)[0]
            if not path.startswith("/"):
                raise Refused(HTTPStatus.BAD_REQUEST, "expected a path")
            rel = path[1:]
            if rel == "api/runs":
                runs = run_summaries(self.server.results, self.server.digests, self.server.superseded())
                listing = {"results": self.server.results_label, "runs": runs}
                body = json.dumps(listing).encode()
                self._send(HTTPStatus.OK, CONTENT_TYPES[".json"], len(body))
                if send_body:
                    self.wfile.write(body)
            elif rel.startswith("results/"):
                full = resolve_under(self.server.results, rel[len("results/"):])
                if not full.endswith(".json"):
                    raise Refused(HTTPStatus.NOT_FOUND, "only .json files are served from the results folder")
                self._send_file(full, send_body)
            else:
                self._send_file(resolve_under(self.server.static, rel or "index.html"), send_body)
        except Refused as refused:
            self._error(refused)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _check_host(self) -> None:
        if self.server.allow_remote:
            return
        host = self.headers.get("Host")
        if host is None:
            return
        try:
            name = urlsplit("//" + host).hostname or ""
        except ValueError:  # "[", "[::1", "[not-an-address]"
            raise Refused(HTTPStatus.BAD_REQUEST, "malformed Host header; use http://127.0.0.1:PORT/") from None
        if name not in LOOPBACK_NAMES and not is_loopback_ip(name):
            raise Refused(HTTPStatus.FORBIDDEN, "unexpected Host header; use http://127.0.0.1:PORT/")

    def _send_file(self, full: str, send_body: bool) -> None:
        with open(full, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            span = parse_range(self.headers.get("Range"), size)
            first, last = span if span else (0, size - 1)
            length = last - first + 1
            if span:
                self._send(HTTPStatus.PARTIAL_CONTENT, content_type(full), length,
                           {"Content-Range": f"bytes {first}-{last}/{size}"})
            else:
                self._send(HTTPStatus.OK, content_type(full), size)
            if send_body:
                f.seek(first)
                while length > 0:
                    chunk = f.read(min(length, 1 << 16))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    length -= len(chunk)

    def _send(self, status: HTTPStatus, ctype: str, length: int, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        # Run files change every step; the page must always see the newest bytes.
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy",
                         "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()

    def _error(self, refused: Refused) -> None:
        body = (str(refused) + "\n").encode()
        self._send(refused.status, "text/plain; charset=utf-8", len(body), refused.headers)
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_request(self, code="-", size="-") -> None:
        # The page polls every few seconds: log only what went wrong, not every poll.
        if isinstance(code, int) and code >= 400 and code != HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE:
            super().log_request(code, size)

    def log_error(self, format, *args) -> None:
        # A connection closed for idling (a browser tab keeping it alive, then left) is routine.
        if not format.startswith("Request timed out"):
            super().log_error(format, *args)


def content_type(path: str) -> str:
    return CONTENT_TYPES.get(os.path.splitext(path)[1], "application/octet-stream")


def is_loopback_ip(name: str) -> bool:
    try:
        return ipaddress.ip_address(name.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def bind_family(host: str, allow_remote: bool) -> socket.AddressFamily:
    """The address family for `host`; refuses a non-loopback address unless `allow_remote`."""
    try:
        infos = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise AndreaError(f"--host {host}: cannot resolve it ({err.strerror})") from None
    if not allow_remote and not all(is_loopback_ip(info[4][0]) for info in infos):
        raise AndreaError(
            f"--host {host or '(all interfaces)'} is reachable from other machines and the dashboard has no "
            "login; pass --allow-remote to bind it anyway, or keep the default 127.0.0.1 and use an SSH tunnel"
        )
    return infos[0][0]


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True
    # The standard library listens with a backlog of 5: a burst of connections (many tabs, a script)
    # overflows it and waits out TCP's retransmission, a second or more. The kernel caps this at
    # net.core.somaxconn.
    request_queue_size = 1024

    def __init__(self, results: str | Path, host: str = "127.0.0.1", port: int = 8765, allow_remote: bool = False,
                 idle_timeout: float = IDLE_TIMEOUT_S):
        self.address_family = bind_family(host, allow_remote)
        results = Path(results)
        if not results.is_dir():
            raise AndreaError(f"{results}: no such folder; pass --results DIR, the folder andrea train writes to")
        self.results = os.path.realpath(results)
        self.results_label = str(results)
        self.static = os.path.realpath(STATIC)
        self.allow_remote = allow_remote
        self.idle_timeout = idle_timeout
        self.digests: dict[tuple[int, int], LossDigest] = {}
        self.survey_lock = threading.Lock()
        self.surveyed: tuple[float, set] | None = None  # (when, superseded_files)
        try:
            super().__init__((host, port), Handler)
        except OSError as err:
            raise AndreaError(f"cannot listen on {host}:{port} ({err.strerror}); pass another --port") from None

    def superseded(self) -> set[tuple[int, int]]:
        """superseded_files of the results folder, asked again once SURVEY_TTL_S has passed."""
        with self.survey_lock:
            now = time.monotonic()
            if self.surveyed is None or now - self.surveyed[0] >= SURVEY_TTL_S:
                self.surveyed = now, superseded_files(self.results)
            return self.surveyed[1]

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"
