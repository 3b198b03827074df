"""The dashboard server: what it serves, what it refuses, and that it only reads."""

import fcntl
import http.client
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from andrea.cli import main as cli_main
from andrea.dashboard.server import STATIC, DashboardServer, parse_record
from andrea.common.errors import AndreaError
from andrea.store.runfiles import iter_records
from conftest import EXPERIMENTS

LOSS_LINES = [
    {"event": "start", "wall": 1.0, "step": 0},
    {"step": 1, "loss": 6.2, "lr": 6e-4, "grad_norm": 0.98, "tokens": 512, "tokens_per_s": 900.0, "time": 0.9},
    {"step": 2, "loss": 6.1, "lr": 1.2e-3, "grad_norm": 1.05, "tokens": 1024, "tokens_per_s": 950.0, "time": 1.4,
     "val_loss": 6.0},
]
SECRET = "not for the dashboard"


@pytest.fixture
def tree(tmp_path):
    """results/ with runs (one nested), and symlinks pointing into and out of it."""
    results, outside = tmp_path / "results", tmp_path / "outside"
    (results / "sub").mkdir(parents=True)
    outside.mkdir()
    loss = "".join(json.dumps(rec) + "\n" for rec in LOSS_LINES)
    (results / "run.loss.json").write_text(loss)
    (results / "run.state.json").write_text(json.dumps({"step": 2, "total_steps": 40, "experiment": {"name": "tiny"}}))
    (results / "run.ckpt").write_bytes(b"\0" * 16)
    (results / "run.log").write_text("training run: steps 0 -> 40 of 40, 512 tokens/step\n")
    (results / "sub" / "other.loss.json").write_text(loss)
    (outside / "secret.json").write_text(json.dumps({"secret": SECRET}))
    (outside / "escaped.loss.json").write_text(loss)
    (results / "link-out.json").symlink_to(outside / "secret.json")
    (results / "linked-out.loss.json").symlink_to(outside / "escaped.loss.json")
    (results / "linkdir").symlink_to(outside, target_is_directory=True)
    (results / "link-in.json").symlink_to(results / "run.state.json")
    return results


@contextmanager
def running(results, **options):
    """A dashboard server on a free loopback port, serving in a background thread."""
    srv = DashboardServer(results, port=0, **options)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def server(tree):
    with running(tree) as srv:
        yield srv


def request(srv, method, path, headers=None, body=None):
    """Send `path` exactly as written (http.client does not normalise it)."""
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=10)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp, data


def test_serves_the_page_and_run_files(server, tree):
    resp, page = request(server, "GET", "/")
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/html")
    assert b"vendor/uPlot.iife.min.js" in page
    for asset in ("/app.js", "/style.css", "/vendor/uPlot.iife.min.js", "/vendor/uPlot.min.css"):
        assert request(server, "GET", asset)[0].status == 200, asset
    resp, data = request(server, "GET", "/results/run.loss.json")
    assert resp.status == 200 and data == (tree / "run.loss.json").read_bytes()
    assert resp.getheader("Cache-Control") == "no-store"


def test_the_page_has_the_per_source_charts(server):
    """The mixture and the per-source losses have their panels, hidden until a run has the fields."""
    page = request(server, "GET", "/")[1].decode()
    for chart in ("chart-mix", "chart-val-sources", "chart-source-loss"):
        figure = page[page.rindex("<figure", 0, page.index(f'id="{chart}"')):page.index(f'id="{chart}"')]
        assert "hidden" in figure, chart
    assert all(f'id="{chart}"' in page for chart in ("chart-loss", "chart-lr", "chart-grad", "chart-tps"))
    script = request(server, "GET", "/app.js")[1].decode()
    for field in ('"mix"', '"val_loss_sources"', '"source_loss"', '"source_sequences"'):
        assert field in script, field


def test_a_mixing_run_is_listed_with_its_phase(tmp_path):
    """Step records with per-source objects (mix, source_loss, ...) are step records like any other."""
    results = tmp_path / "results"
    results.mkdir()
    rec = dict(LOSS_LINES[2], phase="main", mix={"pydocs": 0.7, "noise": 0.3}, source_loss={"pydocs": 6.0},
               source_sequences={"pydocs": 2}, val_loss_sources={"pydocs": 5.9, "noise": 7.1})
    (results / "mixed.loss.json").write_text(json.dumps(LOSS_LINES[0]) + "\n" + json.dumps(rec) + "\n"
                                             + json.dumps(rec)[:50] + "\n")
    with running(results) as srv:
        assert listed(srv, "mixed")["phase"] == "main"


def test_range_sends_only_the_appended_bytes(server, tree):
    full = (tree / "run.loss.json").read_bytes()
    offset = len(full) // 2
    resp, data = request(server, "GET", "/results/run.loss.json", {"Range": f"bytes={offset}-"})
    assert resp.status == 206 and data == full[offset:]
    assert resp.getheader("Content-Range") == f"bytes {offset}-{len(full) - 1}/{len(full)}"
    resp, _ = request(server, "GET", "/results/run.loss.json", {"Range": f"bytes={len(full)}-"})
    assert resp.status == 416 and resp.getheader("Content-Range") == f"bytes */{len(full)}"


@pytest.mark.parametrize("header, begin, end", [
    ("bytes=0-0", 0, 1),
    ("bytes=3-5", 3, 6),
    ("bytes=3-100000", 3, None),
    ("bytes=-5", -5, None),
    ("bytes=-100000", 0, None),
    ("BYTES=0-1", 0, 2),
])
def test_range_forms(server, tree, header, begin, end):
    full = (tree / "run.loss.json").read_bytes()
    first, stop, _ = slice(begin, end).indices(len(full))
    resp, data = request(server, "GET", "/results/run.loss.json", {"Range": header})
    assert resp.status == 206 and data == full[first:stop]
    assert resp.getheader("Content-Range") == f"bytes {first}-{stop - 1}/{len(full)}"
    assert int(resp.getheader("Content-Length")) == stop - first


@pytest.mark.parametrize("header", ["bytes=5-2", "bytes=-0", "bytes=" + "9" * 5000 + "-"])
def test_unsatisfiable_range_is_416(server, tree, header):
    size = (tree / "run.loss.json").stat().st_size
    resp, _ = request(server, "GET", "/results/run.loss.json", {"Range": header})
    assert resp.status == 416 and resp.getheader("Content-Range") == f"bytes */{size}"
    assert int(resp.getheader("Content-Length")) >= 0


@pytest.mark.parametrize("header", [
    "bytes=\xb2-", "bytes=1-\xb2", "bytes=\u0663-", "bytes=-", "bytes=", "bytes=abc-", "bytes=1-2-3", "bytes=+5-",
    "bytes=5_0-", "bytes=0x10-", "bytes= 5-", "bytes=5 -", "bytes=-\xb9",
])
def test_malformed_range_is_400(server, header):
    # Sent as raw bytes: http.client would refuse U+0663, which a client may still send as UTF-8.
    value = header.encode("utf-8") if any(ord(ch) > 255 for ch in header) else header.encode("latin-1")
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(b"GET /results/run.loss.json HTTP/1.1\r\nHost: 127.0.0.1\r\nRange: " + value
                     + b"\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]


@pytest.mark.parametrize("header", ["items=0-5", "bytes=0-1,3-4"])
def test_range_the_server_does_not_take_sends_the_whole_file(server, tree, header):
    resp, data = request(server, "GET", "/results/run.loss.json", {"Range": header})
    assert resp.status == 200 and data == (tree / "run.loss.json").read_bytes()


def test_an_idle_connection_is_closed(tree):
    with running(tree) as srv:
        assert 10 <= srv.idle_timeout <= 120  # long enough for any poll interval a person picks
    with running(tree, idle_timeout=0.3) as srv:
        with socket.create_connection(srv.server_address[:2], timeout=10) as sock:
            start = time.monotonic()
            assert sock.recv(1) == b""  # the server hung up on a client that sent nothing
            assert time.monotonic() - start < 5
        conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=10)
        conn.request("GET", "/api/runs")
        assert conn.getresponse().read()
        time.sleep(1)
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            conn.request("GET", "/api/runs")  # the kept-alive connection was closed while idle
            conn.getresponse()
        conn.close()


def test_a_burst_of_connections_is_queued(tree):
    """200 clients connecting at once all get through the kernel's handshake, then all get served."""
    srv = DashboardServer(tree, port=0)
    socks = []
    serving = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    try:
        for _ in range(200):  # before the server accepts any: only the listen backlog holds them
            sock = socket.socket(srv.address_family, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.connect_ex(srv.server_address[:2])
            socks.append(sock)
        deadline = time.monotonic() + 0.5
        pending = list(socks)
        while pending and time.monotonic() < deadline:
            _, ready, _ = select.select([], pending, [], 0.05)
            pending = [s for s in pending if s not in ready]
        assert not pending, f"{len(pending)} of 200 connections are still waiting for the handshake"
        serving.start()
        for sock in socks:
            sock.setblocking(True)
            sock.settimeout(10)
            sock.sendall(b"HEAD /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        for sock in socks:
            assert sock.recv(64).startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in socks:
            sock.close()
        if serving.is_alive():
            srv.shutdown()
        srv.server_close()


def test_run_list_covers_subfolders_and_skips_links_out(server):
    resp, data = request(server, "GET", "/api/runs")
    runs = {r["id"]: r for r in json.loads(data)["runs"]}
    assert resp.status == 200 and set(runs) == {"run", "sub/other"}
    assert runs["run"]["state"] == {"step": 2, "total_steps": 40, "experiment": "tiny"}
    assert runs["run"]["size"] == len("".join(json.dumps(rec) + "\n" for rec in LOSS_LINES))
    assert runs["sub/other"]["state"] is None


def test_a_hard_linked_copy_is_listed_once(tmp_path):
    """The workflow trains in runs/NAME/KEY/ and hard-links the finished files into results/."""
    results = tmp_path / "results"
    trained = results / "runs" / "tiny" / "3f2a" / "tiny.loss.json"
    trained.parent.mkdir(parents=True)
    trained.write_text("".join(json.dumps(rec) + "\n" for rec in LOSS_LINES))
    (results / "a" / "b").mkdir(parents=True)
    os.link(trained, results / "a" / "b" / "tiny.loss.json")
    with running(results) as srv:
        ids = [r["id"] for r in json.loads(request(srv, "GET", "/api/runs")[1])["runs"]]
        assert ids == ["a/b/tiny"]  # of two nested copies, the one fewer folders down
        os.link(trained, results / "tiny.loss.json")
        (results / "tiny.state.json").write_text(json.dumps({"step": 2, "total_steps": 40}))
        (results / "other.loss.json").write_text(json.dumps(LOSS_LINES[1]) + "\n")
        runs = json.loads(request(srv, "GET", "/api/runs")[1])["runs"]
    assert [r["id"] for r in runs] == ["other", "tiny"]
    assert runs[1]["state"]["total_steps"] == 40


@pytest.mark.parametrize("state", ["null", "[1, 2]", "7", '"text"', '{"experiment": "tiny", "step": 3}', "{torn"])
def test_a_state_file_that_is_not_an_object_is_passed_over(tree, server, state):
    (tree / "run.state.json").write_text(state)
    resp, data = request(server, "GET", "/api/runs")
    runs = {r["id"]: r for r in json.loads(data)["runs"]}
    assert resp.status == 200 and set(runs) == {"run", "sub/other"}
    assert runs["run"]["state"] in (None, {"step": 3, "total_steps": None, "experiment": None})


@pytest.mark.parametrize("path, status", [
    ("/results/../outside/secret.json", 403),
    ("/results/%2e%2e/outside/secret.json", 403),
    ("/results/sub/../../outside/secret.json", 403),
    ("/results/..%2f..%2foutside%2fsecret.json", 403),
    ("/results/..%5coutside%5csecret.json", 403),
    ("/results//etc/passwd", 403),
    ("/results/%2Fetc%2Fpasswd", 403),
    ("/results/link-out.json", 403),
    ("/results/linkdir/secret.json", 403),
    ("/results/linked-out.loss.json", 403),
    ("/../../outside/secret.json", 403),
    ("/%2e%2e/%2e%2e/etc/passwd", 403),
    ("/results/run.ckpt", 404),
    ("/results/run.log", 404),
    ("/results/missing.loss.json", 404),
    ("/results/sub", 404),
])
def test_paths_out_of_the_folder_are_refused(server, path, status):
    resp, data = request(server, "GET", path)
    assert resp.status == status
    assert SECRET.encode() not in data and b"root:" not in data


def test_a_symlink_that_stays_inside_is_served(server, tree):
    resp, data = request(server, "GET", "/results/link-in.json")
    assert resp.status == 200 and data == (tree / "run.state.json").read_bytes()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_read_only(server, tree, method):
    before = {p: p.read_bytes() for p in tree.iterdir() if p.is_file()}
    resp, _ = request(server, method, "/results/run.loss.json", body=b'{"step": 99}\n')
    assert resp.status == 405 and resp.getheader("Allow") == "GET, HEAD"
    assert {p: p.read_bytes() for p in tree.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("method", ["OPTIONS", "TRACE", "CONNECT", "PROPFIND", "FOO"])
def test_other_methods_are_not_allowed(server, method):
    resp, _ = request(server, method, "/results/run.loss.json")
    assert resp.status == 405 and resp.getheader("Allow") == "GET, HEAD"
    assert request(server, "GET", "/api/runs")[0].status == 200


def test_foreign_host_header_is_refused(server):
    port = server.server_address[1]
    assert request(server, "GET", "/api/runs", {"Host": f"attacker.example:{port}"})[0].status == 403
    assert request(server, "GET", "/api/runs", {"Host": f"localhost:{port}"})[0].status == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_non_loopback_bind_needs_the_flag(tree, host):
    with pytest.raises(AndreaError, match="--allow-remote"):
        DashboardServer(tree, host=host, port=0)


def test_cli_refuses_non_loopback_bind_before_listening(tree, capsys):
    assert cli_main(["dashboard", "--results", str(tree), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err


def test_allow_remote_binds_all_interfaces(tree):
    srv = DashboardServer(tree, host="0.0.0.0", port=0, allow_remote=True)
    try:
        assert srv.server_address[0] == "0.0.0.0"
    finally:
        srv.server_close()


def test_missing_results_folder_is_a_clear_error(tmp_path):
    with pytest.raises(AndreaError, match="no such folder"):
        DashboardServer(tmp_path / "nope", port=0)


def test_dashboard_imports_nothing_of_the_engine():
    code = ("import sys, andrea.dashboard.server, andrea.dashboard.cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('andrea.engines', 'andrea.schedule.model', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_real_run_is_listed_with_its_plan(tmp_path, repetitive_data):
    """The run files of `andrea train` as the page sees them: the start event gives the stop
    (--max-steps) and total before any checkpoint, the state file the checkpointed step."""
    results = tmp_path / "results"
    subprocess.run([sys.executable, "-m", "andrea.cli", "train", "--experiment", str(EXPERIMENTS / "ANDREA-tiny-TRAIN.json"),
                    "--data", str(repetitive_data), "--out", str(results / "tiny.ckpt"), "--engine", "numpy",
                    "--max-steps", "2"], check=True, capture_output=True)
    with running(results) as srv:
        (run,) = json.loads(request(srv, "GET", "/api/runs")[1])["runs"]
        loss = request(srv, "GET", "/results/" + run["loss"])[1].decode().splitlines()
    start = json.loads(loss[0])
    assert run["id"] == "tiny" and (start["event"], start["stop"], start["total_steps"]) == ("start", 2, 40)
    assert run["state"] == {"step": 2, "total_steps": 40, "experiment": "ANDREA-tiny"}
    assert [json.loads(line).get("step") for line in loss if '"loss"' in line] == [1, 2]


def phased_history():
    """Records of a run in two phases with both validation losses, a best and a pivot event, and
    lines that are not JSON objects among them."""
    out = [{"event": "start", "wall": 1.0, "step": 0, "stop": 6, "total_steps": 6}]
    for step in range(1, 5):
        rec = dict(LOSS_LINES[1], step=step, phase="main")
        if step % 2 == 0:
            rec.update(val_loss=6.0 - step / 10, val_loss_assistant=5.0 - step / 10)
        out.append(rec)
    out.append({"event": "best", "step": 4, "val_loss": 4.6, "metric": "val_loss_assistant"})
    out.append({"event": "pivot", "wall": 2.0, "step": 4, "from": "main", "to": "polish"})
    return "".join(json.dumps(rec) + "\n" for rec in out) + "null\n[1, 2]\n" + '{"step": 5, "lo\n'


def listed(srv, run_id):
    return {r["id"]: r for r in json.loads(request(srv, "GET", "/api/runs")[1])["runs"]}[run_id]


def test_run_list_gives_the_phase_and_the_best_step(tmp_path):
    """The phase of the newest record (or the one a pivot after it starts) and the newest best event,
    read incrementally as the file grows; a run without them gets null."""
    results = tmp_path / "results"
    results.mkdir()
    run = results / "two.loss.json"
    run.write_text(phased_history())
    (results / "old.loss.json").write_text("".join(json.dumps(rec) + "\n" for rec in LOSS_LINES))
    with running(results) as srv:
        old = listed(srv, "old")
        assert (old["phase"], old["best"]) == (None, None)
        two = listed(srv, "two")
        assert two["phase"] == "polish"  # the pivot after step 4 starts it before any polish record
        assert two["best"] == {"step": 4, "val_loss": 4.6, "metric": "val_loss_assistant"}

        with open(run, "a") as f:  # a half-written line waits; a record glued onto a torn line counts
            f.write(json.dumps(dict(LOSS_LINES[1], step=5, phase="polish"))[:20])
        assert listed(srv, "two")["phase"] == "polish"
        with open(run, "a") as f:
            f.write('"x"\n{"ste' + json.dumps(dict(LOSS_LINES[1], step=5, phase="cooldown")) + "\n")
            f.write(json.dumps({"event": "best", "step": 5, "val_loss": 4.5, "metric": "val_loss_assistant"}) + "\n")
            f.write(json.dumps({"event": "checkpoint", "step": 5}) + "\n")
        two = listed(srv, "two")
        assert two["phase"] == "cooldown" and two["best"]["step"] == 5
        assert len(srv.digests) == 2

        # A fresh start moves the history aside: the new file is read from its first byte.
        run.rename(results / "two.loss.json.old")
        run.write_text(json.dumps(dict(LOSS_LINES[1], step=1)) + "\n")
        two = listed(srv, "two")
        assert (two["phase"], two["best"]) == (None, None)
        assert len(srv.digests) == 2


def test_run_list_reads_a_long_history_in_pieces(tmp_path, monkeypatch):
    """A file longer than one read: the phase and best step found wherever they are."""
    from andrea.dashboard import server as server_module
    monkeypatch.setattr(server_module, "DIGEST_CHUNK", 7)
    results = tmp_path / "results"
    results.mkdir()
    (results / "two.loss.json").write_text(phased_history() + json.dumps({"event": "checkpoint", "step": 4}) + "\n")
    with running(results) as srv:
        two = listed(srv, "two")
    assert two["phase"] == "polish" and two["best"]["step"] == 4


REAL_MAIN, REAL_POLISH = 6, 4


def train_two_phase(tmp_path, tiny_experiment_raw, chat_data):
    """`andrea train` of the tiny model in two phases (main, then polish on assistant tokens) on data
    with loss masks: results/tiny.loss.json as the trainer writes it."""
    raw = {k: v for k, v in tiny_experiment_raw.items() if k not in ("train", "schedule")}
    raw["phases"] = [
        {"name": "main", "length": {"steps": REAL_MAIN}, "lr": {"warmup_steps": 2, "decay": "constant"}},
        {"name": "polish", "length": {"steps": REAL_POLISH}, "lr": {"decay": "linear", "final_ratio": 0.1},
         "loss_on": "assistant", "intervals": {"eval": 2}},
    ]
    raw["intervals"] = {"checkpoint": 0, "sample": 0, "eval": 3, "eval_batches": 2}
    experiment = tmp_path / "tiny-phases.json"
    experiment.write_text(json.dumps(raw))
    results = tmp_path / "results"
    assert cli_main(["train", "--experiment", str(experiment), "--data", str(chat_data),
                     "--out", str(results / "tiny.ckpt"), "--engine", "numpy"]) == 0
    return results


def test_a_real_two_phase_run_is_listed_with_its_phase_and_best(tmp_path, tiny_experiment_raw, chat_data):
    results = train_two_phase(tmp_path, tiny_experiment_raw, chat_data)
    history = list(iter_records(results / "tiny.loss.json"))
    (pivot,) = [r for r in history if r.get("event") == "pivot"]
    best = [r for r in history if r.get("event") == "best"][-1]
    assert (pivot["step"], pivot["from"], pivot["to"]) == (REAL_MAIN, "main", "polish")
    with running(results) as srv:
        run = listed(srv, "tiny")
    assert run["phase"] == "polish"
    assert run["best"] == {"step": best["step"], "val_loss": best["val_loss"], "metric": "val_loss_assistant"}


# Lines that are no record, as the listing meets them: nested deeper than the JSON parser goes (one
# holding "best", which the listing parses looking for the newest best event), or built to make a
# search for a record glued onto a torn line cost time.
HOSTILE = {
    "deep array": b"[" * 100_000,
    "deep object": b'{"a":' * 100_000,
    "deep best": b'{"event": "best", "step": 9, "a": ' + b"[" * 100_000,
    "deep closed": b'{"step": 9, "phase": "deep", "a":' * 50_000 + b"1" + b"}" * 50_000,
    "braces": b"{" * 320_000,
    "braces closed": b"{" * 320_000 + b"}" * 1_000,
    "nested objects": b'{"a": ' + b'{"b": 0}, ' * 32_000 + b"}",
    "overlong record": json.dumps({"step": 9, "phase": "long", "pad": "x" * (2 << 20)}).encode(),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_lines_are_passed_over_by_the_listing(tmp_path, name):
    """The phase and best step of the lines around a hostile one, in a listing that takes well under
    a second (the search for a glued record is one pass over the line, not one per "{")."""
    results = tmp_path / "results"
    results.mkdir()
    run = results / "two.loss.json"
    run.write_bytes(phased_history().encode() + HOSTILE[name] + b"\n")
    with running(results) as srv:
        start = time.monotonic()
        two = listed(srv, "two")
        took = time.monotonic() - start
        assert (two["phase"], two["best"]["step"]) == ("polish", 4)
        assert took < 1.5, f"{took:.2f} s"
        with open(run, "ab") as f:  # and the listing goes on from there
            f.write(HOSTILE[name] + b"\n" + json.dumps(dict(LOSS_LINES[1], step=5, phase="cooldown")).encode() + b"\n")
            f.write(json.dumps({"event": "best", "step": 5, "val_loss": 4.5}).encode() + b"\n" + HOSTILE[name] + b"\n")
        two = listed(srv, "two")
    assert (two["phase"], two["best"]["step"]) == ("cooldown", 5)


@pytest.mark.parametrize("name", ["braces", "deep object", "nested objects", "braces closed"])
def test_a_record_glued_after_a_hostile_line_is_found_in_linear_time(name):
    """Twice the line costs about twice the time (the search it replaced took 6 s for 320,000 "{")."""
    record = json.dumps(dict(LOSS_LINES[1], phase="polish")).encode()
    took = []
    for times in (1, 2):
        line = HOSTILE[name] * times
        start = time.monotonic()
        assert parse_record(line) in (None, {})  # "{}" ends a run of braces closed by its last "}"
        assert parse_record(line + record) == json.loads(record)
        took.append(time.monotonic() - start)
    assert took[1] < 1.0, took


def test_a_line_that_never_ends_is_not_held(tmp_path):
    """A line growing by a megabyte a listing, with no newline: the digest keeps at most a record's
    worth of it and reads on from the line after."""
    from andrea.store.runfiles import MAX_RECORD_BYTES
    results = tmp_path / "results"
    results.mkdir()
    run = results / "two.loss.json"
    run.write_text(phased_history())
    with running(results) as srv:
        for _ in range(4):
            with open(run, "ab") as f:
                f.write(b'{"step": 9, "phase": "endless", "a": "' + b"x" * (1 << 20))
            assert listed(srv, "two")["phase"] == "polish"
            assert all(len(d.tail) <= MAX_RECORD_BYTES for d in srv.digests.values())
        with open(run, "ab") as f:
            f.write(b'"}\n' + json.dumps(dict(LOSS_LINES[1], step=5, phase="cooldown")).encode() + b"\n")
        assert listed(srv, "two")["phase"] == "cooldown"


@pytest.mark.parametrize("state", [b"[" * 100_000, b'{"a":' * 100_000, b'{"step": 3, "pad": "' + b"x" * (2 << 20) + b'"}'])
def test_a_hostile_state_file_is_passed_over(tree, server, state):
    (tree / "run.state.json").write_bytes(state)
    resp, data = request(server, "GET", "/api/runs")
    assert resp.status == 200 and {r["id"]: r for r in json.loads(data)["runs"]}["run"]["state"] is None


def raw_exchange(srv, data: bytes, timeout: float = 5) -> bytes:
    """Send `data` on a fresh loopback connection and read until the server closes it."""
    with socket.create_connection(srv.server_address[:2], timeout=timeout) as sock:
        sock.sendall(data)
        reply = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (chunk := sock.recv(65536)):
            reply += chunk
    return reply


@pytest.mark.parametrize("host", [b"[", b"[::1", b"]", b"[zz]", b"[127.0.0.1]"])
def test_an_unparsable_host_is_400(server, host):
    reply = raw_exchange(server, b"GET /api/runs HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), reply[:200]
    assert 0 < len(body) < 200 and b"Host" in body
    assert request(server, "GET", "/api/runs")[0].status == 200


def test_a_slow_request_is_cut_at_its_deadline(tree, monkeypatch):
    """A client trickling its headers a byte at a time (never idle for long) gets 408 and a closed
    connection once the request's deadline passes; other clients are served meanwhile."""
    from andrea.dashboard import server as server_module
    deadline = getattr(server_module, "REQUEST_DEADLINE_S", 0)
    monkeypatch.setattr(server_module, "REQUEST_DEADLINE_S", 0.6, raising=False)
    trickle = b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
    with running(tree) as srv, socket.create_connection(srv.server_address[:2], timeout=5) as sock:
        start = time.monotonic()
        reply, served = b"", []
        for byte in trickle:  # at most 200 bytes, 0.05 s apart: 10 s
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            if not served and time.monotonic() - start > 0.2:
                served.append(request(srv, "GET", "/api/runs")[0].status)
            if select.select([sock], [], [], 0.05)[0]:
                break
        closed_after = time.monotonic() - start
        sock.settimeout(3)
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    assert served == [200]
    assert closed_after < 0.6 + 1.5, f"{closed_after:.2f} s"
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert 5 <= deadline <= 30  # long enough for any client that is not stalling on purpose


def test_a_request_on_time_is_served_after_an_idle_wait(tree, monkeypatch):
    """The deadline runs from a request's first byte: a kept-alive connection idle for longer than
    the deadline (but within the idle timeout) still carries the next request."""
    from andrea.dashboard import server as server_module
    monkeypatch.setattr(server_module, "REQUEST_DEADLINE_S", 0.3, raising=False)
    with running(tree) as srv:
        conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=10)
        conn.request("GET", "/api/runs")
        assert conn.getresponse().read()
        time.sleep(0.6)
        conn.request("GET", "/api/runs")
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["runs"]
        conn.close()


def test_the_page_reads_lines_as_the_server_does(tmp_path):
    """The page's parseRecord (static/app.js, run by Node) on torn, glued and hostile lines: the same
    record as the server's parse_record, each within a second."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("needs Node.js to run the page's reader")
    script = (STATIC / "app.js").read_text()
    reader = [re.search(rf"^const {name} = .*$", script, re.M).group() for name in ("encoder", "MAX_RECORD_BYTES")]
    reader += [re.search(rf"^function {name}\(.*?^}}$", script, re.M | re.S).group()
               for name in ("parseRecord", "parseObject", "gluedRecordStart")]
    record = json.dumps(dict(LOSS_LINES[1], step=5, phase="polish", note='a \\"{[ }\\')).encode()
    lines = [record, b"null", b"[1, 2]", b'"{}"', b"[" + record + b"]", record[:30], record[:30] + record,
             b'{"phase": "pol' + record, b'{"a": "\\' + record, b'{"a": "\\\\' + record, b"{}  ", b"x" + record + b" \t"]
    lines += [line + tail for name, line in HOSTILE.items() if name != "deep closed" for tail in (b"", record)]
    (tmp_path / "lines.json").write_text(json.dumps([line.decode() for line in lines]))
    (tmp_path / "read.js").write_text("\n".join(reader) + """
const fs = require("fs");
const out = JSON.parse(fs.readFileSync(process.argv[2], "utf8")).map((line) => {
  const start = Date.now();
  const rec = parseRecord(line);
  return {rec, ms: Date.now() - start};
});
console.log(JSON.stringify(out));
""")
    ran = subprocess.run([node, tmp_path / "read.js", tmp_path / "lines.json"], capture_output=True, text=True,
                         timeout=60, check=True)
    for line, got in zip(lines, json.loads(ran.stdout), strict=True):
        assert got["rec"] == parse_record(line), line[:80]
        assert got["ms"] < 1000, (line[:80], got["ms"])


def workflow_runs(results, long_name="EXP"):
    """results/ as the workflow leaves it after three runs of one experiment: `old` superseded, `cur` linked
    into results/ (with samples at two steps, text with markup included), `live` older but running (its
    lock is held by the returned file, as a trainer would hold it; close it to let go)."""
    history = "".join(json.dumps(rec) + "\n" for rec in LOSS_LINES)
    folders = {}
    for key, days in (("old", 1), ("live", 2), ("cur", 3)):
        folder = results / "runs" / long_name / key
        folder.mkdir(parents=True)
        state = {"step": 2, "total_steps": 40, "experiment": {"name": long_name}}
        for suffix, text in ((".loss.json", history), (".state.json", json.dumps(state)), (".ckpt", "\0" * 16),
                             (".lock", "")):
            (folder / f"{long_name}{suffix}").write_text(text)
            os.utime(folder / f"{long_name}{suffix}", (1.7e9 + days * 86400,) * 2)
        folders[key] = folder
    for suffix in (".loss.json", ".state.json", ".ckpt"):
        os.link(folders["cur"] / f"{long_name}{suffix}", results / f"{long_name}{suffix}")
    samples = [{"step": 1, "samples": [{"prompt": "early", "completion": "old text"}]},
               {"step": 2, "samples": [{"prompt": "Say <b>hi</b> & bye", "completion": "<script>alert(1)</script>\nsecond line"},
                                       {"prompt": "2nd", "completion": "ok"}]}]
    (folders["cur"] / f"{long_name}.samples.json").write_text(json.dumps(samples))
    lock = open(folders["live"] / f"{long_name}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return lock


def test_run_list_tells_current_runs_from_superseded_ones_and_finds_samples(tmp_path):
    """Current: linked into results/ (listed under results/NAME) or running; superseded: what
    `andrea runs --prune` would remove. The samples file lies beside the run's folder copy of the history."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "plain.loss.json").write_text(json.dumps(LOSS_LINES[1]) + "\n")  # no run folder: current
    lock = workflow_runs(results)
    try:
        with running(results) as srv:
            runs = {r["id"]: r for r in json.loads(request(srv, "GET", "/api/runs")[1])["runs"]}
            assert {i: r["current"] for i, r in runs.items()} == {
                "EXP": True, "plain": True, "runs/EXP/live/EXP": True, "runs/EXP/old/EXP": False}
            assert runs["EXP"]["samples"]["path"] == "runs/EXP/cur/EXP.samples.json"
            assert runs["EXP"]["samples"]["size"] == (results / "runs/EXP/cur/EXP.samples.json").stat().st_size
            assert runs["plain"]["samples"] is None and runs["runs/EXP/old/EXP"]["samples"] is None
            resp, data = request(srv, "GET", "/" + "results/" + runs["EXP"]["samples"]["path"])
            assert resp.status == 200 and json.loads(data)[1]["step"] == 2
            # The survey is cached for SURVEY_TTL_S: a run stopped meanwhile is seen later, not at once.
            lock.close()
            srv.surveyed = None
            runs = {r["id"]: r for r in json.loads(request(srv, "GET", "/api/runs")[1])["runs"]}
            assert not runs["runs/EXP/live/EXP"]["current"]
    finally:
        lock.close()


def test_the_page_has_the_superseded_toggle_and_the_samples_panel(server):
    page = request(server, "GET", "/")[1].decode()
    assert 'id="all"' in page and 'id="samples"' in page
    script = request(server, "GET", "/app.js")[1].decode()
    assert 'get("all")' in script and "textContent = completion" in script
