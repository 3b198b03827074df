"""The dashboard server: what it serves, what it refuses, and that it only reads."""

import http.client
import json
import subprocess
import sys
import threading
from contextlib import contextmanager

import pytest

from andrea.cli import main as cli_main
from andrea.dashboard.server import DashboardServer
from andrea.errors import AndreaError
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
def running(results):
    """A dashboard server on a free loopback port, serving in a background thread."""
    srv = DashboardServer(results, port=0)
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


def test_range_sends_only_the_appended_bytes(server, tree):
    full = (tree / "run.loss.json").read_bytes()
    offset = len(full) // 2
    resp, data = request(server, "GET", "/results/run.loss.json", {"Range": f"bytes={offset}-"})
    assert resp.status == 206 and data == full[offset:]
    assert resp.getheader("Content-Range") == f"bytes {offset}-{len(full) - 1}/{len(full)}"
    resp, _ = request(server, "GET", "/results/run.loss.json", {"Range": f"bytes={len(full)}-"})
    assert resp.status == 416 and resp.getheader("Content-Range") == f"bytes */{len(full)}"


def test_run_list_covers_subfolders_and_skips_links_out(server):
    resp, data = request(server, "GET", "/api/runs")
    runs = {r["id"]: r for r in json.loads(data)["runs"]}
    assert resp.status == 200 and set(runs) == {"run", "sub/other"}
    assert runs["run"]["state"] == {"step": 2, "total_steps": 40, "experiment": "tiny"}
    assert runs["run"]["size"] == len("".join(json.dumps(rec) + "\n" for rec in LOSS_LINES))
    assert runs["sub/other"]["state"] is None


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
            "print(sorted(m for m in sys.modules if m.startswith(('andrea.engines', 'andrea.model', 'numpy'))))")
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
