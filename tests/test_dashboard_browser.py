"""The dashboard page in headless Chromium: it follows a run as it grows, and its controls work.

Needs Debian's `chromium` and Playwright from PyPI (no browser download); skipped without them.
The screenshot goes to tests/artifacts/ (or $ANDREA_TEST_ARTIFACTS).
"""

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from test_dashboard import REAL_MAIN, running, train_two_phase, workflow_runs

sync_api = pytest.importorskip("playwright.sync_api", reason="needs Playwright: pip install playwright")
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs a Chromium binary: apt-get install chromium")

# Flags that keep a headless Chromium from reaching for the network (updates, sync, QUIC probes).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("ANDREA_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))
TOKENS_PER_STEP = 512
TOTAL_STEPS = 200


def record(step):
    rec = {"step": step, "loss": 2.0 + 4.0 * math.exp(-step / 30) + 0.1 * math.sin(step), "lr": 3e-3,
           "grad_norm": 1.0 / (1 + step / 50), "tokens": step * TOKENS_PER_STEP, "tokens_per_s": 1000.0 + step,
           "time": 0.5 * step}
    if step % 10 == 0:
        rec["val_loss"] = rec["loss"] - 0.05
    return rec


def lines(steps):
    return "".join(json.dumps(record(s)) + "\n" for s in steps)


def append(path, text):
    with open(path, "a") as f:
        f.write(text)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    # The page's Content-Security-Policy forbids eval, which Playwright's string predicates use.
    context = browser.new_context(viewport={"width": 1400, "height": 900}, bypass_csp=True)
    pg = context.new_page()
    errors = []
    pg.on("pageerror", lambda err: errors.append(str(err)))
    yield pg
    context.close()
    assert not errors, errors


def points(page, label):
    """Non-empty points of the loss-chart series named `label`."""
    return page.evaluate("""(label) => {
        const u = window.andreaDashboard.charts.loss;
        if (!u) return 0;
        const i = u.series.findIndex((s) => s.label === label);
        return i < 0 ? 0 : u.data[i].filter((v) => v != null).length;
    }""", label)


def wait_points(page, label, n):
    page.wait_for_function("""([label, n]) => {
        const u = window.andreaDashboard.charts.loss;
        const i = u ? u.series.findIndex((s) => s.label === label) : -1;
        return i >= 0 && u.data[i].filter((v) => v != null).length === n;
    }""", arg=[label, n], timeout=10_000)


def test_page_follows_a_growing_run_and_its_controls_work(tmp_path, page, capsys):
    results = tmp_path / "results"
    results.mkdir()
    live = results / "live.loss.json"
    live.write_text(json.dumps({"event": "start", "wall": 0, "step": 0}) + "\n" + lines(range(1, 21)))
    (results / "live.state.json").write_text(json.dumps({"step": 0, "total_steps": TOTAL_STEPS}))
    (results / "other.loss.json").write_text(lines(range(1, 41)))

    with running(results) as srv:
        ranges = []
        page.on("request", lambda r: ranges.append(r.headers.get("range")) if r.url.endswith("live.loss.json") else None)
        page.goto(f"http://127.0.0.1:{srv.server_address[1]}/?poll=200#runs=live")

        # The chart grows while the run appends, half-written lines included.
        wait_points(page, "live loss", 20)
        more = lines(range(21, 51))
        append(live, more[:-40])
        wait_points(page, "live loss", 49)
        append(live, more[-40:])
        wait_points(page, "live loss", 50)
        assert any(r and r.startswith("bytes=") and r != "bytes=0-" for r in ranges), "polls should read only appended bytes"
        steps = page.evaluate("window.andreaDashboard.runs.get('live').records.map((r) => r.step)")
        assert steps == list(range(1, 51))

        # The header: latest numbers, live status, an ETA from the state file's total_steps.
        row = page.locator("tr[data-run=live]")
        assert row.locator("[data-cell=step]").inner_text() == f"50 / {TOTAL_STEPS}"
        assert row.locator("[data-cell=status]").inner_text() == "live"
        assert row.locator("[data-cell=eta]").inner_text() == "1m 15s"  # 150 steps at 0.5 s
        assert row.locator("[data-cell=val]").inner_text() == f"{record(50)['val_loss']:.4f}"

        # A repeated step: the later line wins.
        append(live, json.dumps(dict(record(50), loss=9.5)) + "\n")
        page.wait_for_function("window.andreaDashboard.runs.get('live').last.loss === 9.5", timeout=10_000)
        append(live, json.dumps(record(50)) + "\n")
        page.wait_for_function("window.andreaDashboard.runs.get('live').last.loss < 9", timeout=10_000)

        # Log scale.
        page.click("#log")
        page.wait_for_function("window.andreaDashboard.charts.loss.scales.y.distr === 3")
        page.click("#log")
        page.wait_for_function("window.andreaDashboard.charts.loss.scales.y.distr === 1")

        # x axis: steps, tokens, wall time.
        last_x = "(() => { const d = window.andreaDashboard.charts.loss.data[0]; return d[d.length - 1]; })()"
        for mode, expected in (("tokens", 50 * TOKENS_PER_STEP), ("time", 25.0), ("step", 50)):
            page.click(f"[data-x={mode}]")
            page.wait_for_function(f"{last_x} === {expected}")
            assert page.get_attribute(f"[data-x={mode}]", "aria-checked") == "true"

        # Smoothing: 0 leaves the raw curve; more smoothing moves the EMA away from it.
        def set_smoothing(value):
            page.eval_on_selector("#smooth", "(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }", value)

        series = "(label) => { const u = window.andreaDashboard.charts.loss; return u.data[u.series.findIndex((s) => s.label === label)]; }"
        set_smoothing(0)
        assert page.evaluate(f"({series})('live loss EMA')") == page.evaluate(f"({series})('live loss')")
        set_smoothing(0.95)
        assert page.inner_text("#smooth-value") == "0.95"
        assert page.evaluate(f"({series})('live loss EMA')") != page.evaluate(f"({series})('live loss')")
        assert "smooth=0.95" in page.evaluate("location.hash")

        # Run selection: tick a second run to overlay it, untick it to remove it.
        assert points(page, "other loss") == 0
        page.check("tr[data-run=other] input")
        wait_points(page, "other loss", 40)
        assert points(page, "live loss") == 50
        page.uncheck("tr[data-run=other] input")
        page.wait_for_function("!window.andreaDashboard.charts.loss.series.some((s) => s.label === 'other loss')")
        page.check("tr[data-run=other] input")
        wait_points(page, "other loss", 40)

        # Hover read-out.
        box = page.locator("#chart-loss .u-over").bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] * 0.5)
        page.wait_for_selector("#tip", state="visible")
        assert "step" in page.inner_text("#tip") and "other" in page.inner_text("#tip")

        # Dragging across one chart zooms every chart to that x range; a double-click undoes it.
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.9, box["y"] + box["height"] * 0.5, steps=5)
        page.mouse.up()
        x_range = "['loss', 'lr'].map((n) => window.andreaDashboard.charts[n].scales.x).map((s) => [s.min, s.max])"
        (loss_min, loss_max), (lr_min, lr_max) = page.evaluate(x_range)
        assert 20 < loss_min < loss_max < 50 and (lr_min, lr_max) == (loss_min, loss_max)
        page.mouse.dblclick(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
        page.wait_for_function(f"{x_range}[0][0] < 2")

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        page.screenshot(path=str(shot))
        with capsys.disabled():
            print(f"\ndashboard screenshot: {shot}")

        # A fresh start moves the old history aside and writes a new file: the page starts over.
        live.rename(results / "live.loss.json.old")
        live.write_text(lines(range(1, 6)))
        wait_points(page, "live loss", 5)


def test_page_opens_from_file_and_reads_a_dropped_run(tmp_path, page):
    """Without a server (file://) the page reads a .loss.json given through its file picker."""
    static = Path(__file__).resolve().parents[1] / "andrea" / "dashboard" / "static"
    run = tmp_path / "finished.loss.json"
    run.write_text(lines(range(1, 31)))
    page.goto(static.joinpath("index.html").as_uri())
    assert "file://" in page.inner_text("#empty")
    page.set_input_files("#pick", str(run))
    wait_points(page, "finished loss", 30)
    assert page.locator("tr[data-run=finished] [data-cell=step]").inner_text() == "30"


def steps_read(page, run):
    return page.evaluate("(id) => window.andreaDashboard.runs.get(id).records.map((r) => r.step)", run)


def test_page_skips_lines_that_are_not_json_objects(tmp_path, page):
    """A line that is not a JSON object (torn by a full disk, `null`, a number, an array, garbage) is
    passed over; the records around it, and one appended onto a torn line, are drawn. A last line
    still being written waits for the rest, also when its first bytes are not an object yet."""
    results = tmp_path / "results"
    results.mkdir()
    run = results / "torn.loss.json"
    run.write_text(lines([1, 2]) + "null\n" + lines([3]) + '42\n[1, 2]\n"text"\ntrue\n}{ not json\n\n'
                   + json.dumps(record(4))[:25] + json.dumps(record(5)) + "\n"  # torn, then appended to
                   + lines([6]) + json.dumps(record(7))[:30] + "\n" + lines([8]))
    good = [1, 2, 3, 5, 6, 8]

    with running(results) as srv:
        page.goto(f"http://127.0.0.1:{srv.server_address[1]}/?poll=200#runs=torn")
        wait_points(page, "torn loss", len(good))
        assert steps_read(page, "torn") == good
        read_to_end = "([id, size]) => window.andreaDashboard.runs.get(id).offset === size"

        append(run, "nul")
        page.wait_for_function(read_to_end, arg=["torn", run.stat().st_size], timeout=10_000)
        append(run, "l\n" + lines([9])[:20])
        page.wait_for_function(read_to_end, arg=["torn", run.stat().st_size], timeout=10_000)
        assert steps_read(page, "torn") == good
        append(run, lines([9])[20:] + "[]\n" + lines([10]))
        wait_points(page, "torn loss", len(good) + 2)
        assert steps_read(page, "torn") == good + [9, 10]
        assert "error" not in page.get_attribute("#source", "class")

    static = Path(__file__).resolve().parents[1] / "andrea" / "dashboard" / "static"
    page.goto(static.joinpath("index.html").as_uri())
    page.set_input_files("#pick", str(run))
    wait_points(page, "torn loss", len(good) + 2)
    assert steps_read(page, "torn") == good + [9, 10]


# A run trained in phases: "main" to step PIVOT, then "polish"; validation every 10 steps over all
# target tokens and over assistant tokens; the best checkpoint at step BEST.
PIVOT, BEST = 60, 50


def phased_record(step):
    rec = dict(record(step), phase="main" if step <= PIVOT else "polish")
    if "val_loss" in rec:
        rec["val_loss_assistant"] = rec["val_loss"] - 0.4
    return rec


def phased_lines(steps):
    out = ""
    for s in steps:
        out += json.dumps(phased_record(s)) + "\n"
        if s == BEST:
            out += json.dumps({"event": "best", "step": BEST, "val_loss": phased_record(BEST)["val_loss_assistant"],
                               "metric": "val_loss_assistant"}) + "\n"
        if s == PIVOT:
            out += json.dumps({"event": "pivot", "wall": 1.0, "step": PIVOT, "from": "main", "to": "polish"}) + "\n"
    return out


CHART_IDS = ("chart-loss", "chart-lr", "chart-grad", "chart-tps")


def phases_drawn(page):
    """What each chart drew as phase boundaries (the page's data-phases on the chart elements)."""
    return {el: json.loads(page.get_attribute(f"#{el}", "data-phases") or "null") for el in CHART_IDS}


def wait_phases(page, xs):
    page.wait_for_function("""(xs) => ["chart-loss", "chart-lr", "chart-grad", "chart-tps"].every((id) => {
        const drawn = JSON.parse(document.getElementById(id).dataset.phases || "null");
        return drawn && JSON.stringify(drawn.map((d) => d.x)) === JSON.stringify(xs);
    })""", arg=xs, timeout=10_000)


def series_labels(page, chart="loss"):
    return page.evaluate("(n) => window.andreaDashboard.charts[n].series.map((s) => s.label)", chart)


def test_page_draws_phase_boundaries_and_both_validation_series(tmp_path, page):
    results = tmp_path / "results"
    results.mkdir()
    run = results / "two.loss.json"
    # Torn and foreign lines among the records, as a full disk or a crash leaves them.
    text = json.dumps({"event": "start", "wall": 0, "step": 0, "stop": 80, "total_steps": 80}) + "\n" + phased_lines(range(1, 60))
    run.write_text(text + "null\n" + json.dumps(phased_record(60))[:30] + "\n" + phased_lines([60]))
    (results / "old.loss.json").write_text(lines(range(1, 41)))

    with running(results) as srv:
        page.goto(f"http://127.0.0.1:{srv.server_address[1]}/?poll=200#runs=two")
        wait_points(page, "two loss", 60)
        row = page.locator("tr[data-run=two]")
        assert row.locator("[data-cell=phase]").inner_text() == "polish"  # the pivot after step 60 starts it
        wait_phases(page, [PIVOT])
        assert phases_drawn(page)["chart-lr"] == [{"run": "two", "step": PIVOT, "x": PIVOT, "from": "main", "to": "polish"}]

        append(run, phased_lines(range(61, 81)))
        wait_points(page, "two loss", 80)
        assert row.locator("[data-cell=phase]").inner_text() == "polish"

        # Both validation series, each with its own colour and key entry.
        assert series_labels(page) == ["step", "two loss", "two loss EMA", "two val loss", "two val loss (assistant)"]
        wait_points(page, "two val loss (assistant)", 8)
        assert points(page, "two val loss") == 8
        strokes = page.evaluate("window.andreaDashboard.charts.loss.series.slice(3).map((s) => s._stroke)")
        assert len(set(strokes)) == 2, strokes
        assert page.is_visible("#key-assistant") and page.is_visible("#key-phase")
        assert "assistant" in page.inner_text("#key-assistant")

        # The header: both latest validation losses, the phase, the best step.
        last = phased_record(80)
        assert row.locator("[data-cell=val]").inner_text() == f"{last['val_loss']:.4f}"
        assert row.locator("[data-cell=val_assistant]").inner_text() == f"{last['val_loss_assistant']:.4f}"
        assert row.locator("[data-cell=best]").inner_text() == f"{phased_record(BEST)['val_loss_assistant']:.4f} @ {BEST}"
        assert "val_loss_assistant" in row.locator("[data-cell=best]").get_attribute("title")
        for col in ("phase", "asst", "best"):
            assert page.is_visible(f"#runs th.opt-{col}"), col

        # With x in tokens or time the boundary sits at the pivot step's record.
        for mode, x in (("tokens", PIVOT * TOKENS_PER_STEP), ("time", 0.5 * PIVOT), ("step", PIVOT)):
            page.click(f"[data-x={mode}]")
            wait_phases(page, [x])

        # The hover read-out names the phase and the assistant loss.
        box = page.locator("#chart-loss .u-over").bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.95, box["y"] + box["height"] * 0.5)
        page.wait_for_selector("#tip", state="visible")
        assert "polish" in page.inner_text("#tip") and "val asst" in page.inner_text("#tip")

        # Overlaid with a run without phases: its lines add no boundary, its row no phase.
        page.check("tr[data-run=old] input")
        wait_points(page, "old loss", 40)
        assert [d["run"] for d in phases_drawn(page)["chart-loss"]] == ["two"]
        assert "old val loss (assistant)" not in series_labels(page)
        assert page.locator("tr[data-run=old] [data-cell=phase]").inner_text() == ""

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-phases.png"))

    # From disk (file://) the same file draws the same.
    static = Path(__file__).resolve().parents[1] / "andrea" / "dashboard" / "static"
    page.goto(static.joinpath("index.html").as_uri())
    page.set_input_files("#pick", str(run))
    wait_points(page, "two val loss (assistant)", 8)
    wait_phases(page, [PIVOT])


def test_a_run_not_read_shows_the_servers_phase_and_best(tmp_path, page):
    """An unticked run is not read by the page: its phase and best step come from /api/runs."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "two.loss.json").write_text(phased_lines(range(1, 71)))
    (results / "old.loss.json").write_text(lines(range(1, 41)))
    with running(results) as srv:
        page.goto(f"http://127.0.0.1:{srv.server_address[1]}/?poll=200#runs=old")
        wait_points(page, "old loss", 40)
        row = page.locator("tr[data-run=two]")
        page.wait_for_function("document.querySelector('tr[data-run=two] [data-cell=phase]').textContent === 'polish'",
                               timeout=10_000)
        assert row.locator("[data-cell=best]").inner_text() == f"{phased_record(BEST)['val_loss_assistant']:.4f} @ {BEST}"
        assert page.evaluate("window.andreaDashboard.runs.get('two').records.length") == 0
        assert phases_drawn(page)["chart-loss"] == []


def test_a_run_without_phases_renders_as_before(tmp_path, page):
    """Records without phase, val_loss_assistant or best events: no boundary, no extra series, key or
    column; the charts hold the series they always did."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "old.loss.json").write_text(json.dumps({"event": "start", "wall": 0, "step": 0}) + "\n"
                                           + lines(range(1, 41)) + json.dumps({"event": "checkpoint", "step": 40}) + "\n")
    with running(results) as srv:
        page.goto(f"http://127.0.0.1:{srv.server_address[1]}/?poll=200")
        wait_points(page, "old loss", 40)
        assert series_labels(page) == ["step", "old loss", "old loss EMA", "old val loss"]
        assert points(page, "old val loss") == 4
        # No per-source chart: their figures stay hidden and no uPlot is built for them.
        assert sorted(page.evaluate("Object.keys(window.andreaDashboard.charts)")) == ["grad", "loss", "lr", "tps"]
        for el in ("chart-mix", "chart-val-sources", "chart-source-loss"):
            assert not page.is_visible(f"#{el}"), el
        assert all(drawn == [] for drawn in phases_drawn(page).values())
        assert not page.is_visible("#key-assistant") and not page.is_visible("#key-phase")
        for col in ("phase", "asst", "best"):
            assert not page.is_visible(f"#runs th.opt-{col}"), col
        headers = page.locator("#runs thead th").all_inner_texts()
        visible = [h for h, el in zip(headers, page.locator("#runs thead th").all()) if el.is_visible()]
        assert visible == ["", "run", "status", "step", "loss (EMA)", "val loss", "lr", "grad norm", "tokens/s",
                           "tokens", "elapsed", "ETA"]
        assert page.locator("tr[data-run=old] [data-cell=val]").inner_text() == f"{record(40)['val_loss']:.4f}"


def test_page_draws_a_real_two_phase_run(tmp_path, page, tiny_experiment_raw, chat_data):
    """The loss history `andrea train` writes for two phases on data with loss masks."""
    results = train_two_phase(tmp_path, tiny_experiment_raw, chat_data)
    with running(results) as srv:
        page.goto(f"http://127.0.0.1:{srv.server_address[1]}/?poll=200#runs=tiny")
        wait_points(page, "tiny loss", 10)
        wait_phases(page, [REAL_MAIN])
        assert points(page, "tiny val loss (assistant)") == points(page, "tiny val loss") > 0
        row = page.locator("tr[data-run=tiny]")
        assert row.locator("[data-cell=phase]").inner_text() == "polish"
        assert " @ " in row.locator("[data-cell=best]").inner_text()


# A run that mixes data sources, in two phases: the mixture changes at the pivot; "noise" is drawn
# only from step 5 on (its first training loss comes later than the others'); validation per source
# at the eval interval. A source's name is any string, markup included.
SOURCES = ("pydocs", "wordnet", "web <raw>")


def mixture(step):
    p = 0.6 if step <= PIVOT else 0.2
    return {"pydocs": p, "wordnet": round(0.9 - p, 6), "web <raw>": 0.1}


def mixed_record(step, sources=SOURCES):
    rec = phased_record(step)
    mix = {name: p for name, p in mixture(step).items() if name in sources}
    drawn = [name for name in sources if name != "web <raw>" or step >= 5]
    rec.update(mix=mix, source_loss={name: rec["loss"] + 0.1 * k for k, name in enumerate(drawn)},
               source_sequences={name: 4 - k for k, name in enumerate(drawn)})
    if "val_loss" in rec:
        rec["val_loss_sources"] = {name: rec["val_loss"] + 0.2 * k for k, name in enumerate(sources)}
    return rec


def mixed_lines(steps, sources=SOURCES):
    out = ""
    for s in steps:
        out += json.dumps(mixed_record(s, sources)) + "\n"
        if s == PIVOT:
            out += json.dumps({"event": "pivot", "wall": 1.0, "step": PIVOT, "from": "main", "to": "polish"}) + "\n"
    return out


SOURCE_CHARTS = {"mix": "chart-mix", "val_sources": "chart-val-sources", "source_loss": "chart-source-loss"}


def source_charts_shown(page):
    return {name: page.is_visible(f"#{el}") for name, el in SOURCE_CHARTS.items()}


def test_page_draws_the_mixture_and_the_losses_per_source(tmp_path, page):
    results = tmp_path / "results"
    results.mkdir()
    run = results / "mixed.loss.json"
    run.write_text(json.dumps({"event": "start", "wall": 0, "step": 0, "stop": 80, "total_steps": 80}) + "\n"
                   + mixed_lines(range(1, 71)) + "null\n" + json.dumps(mixed_record(71))[:40] + "\n")
    (results / "other.loss.json").write_text(mixed_lines(range(1, 41), sources=("wordnet", "pydocs")))
    (results / "old.loss.json").write_text(lines(range(1, 41)))

    with running(results) as srv:
        page.goto(f"http://127.0.0.1:{srv.server_address[1]}/?poll=200#runs=mixed")
        wait_points(page, "mixed loss", 70)
        assert source_charts_shown(page) == {"mix": True, "val_sources": True, "source_loss": True}
        assert series_labels(page, "mix") == ["step", "mixed mix (pydocs)", "mixed mix (wordnet)", "mixed mix (web <raw>)"]
        assert series_labels(page, "val_sources") == ["step", "mixed val loss (pydocs)", "mixed val loss (wordnet)",
                                                      "mixed val loss (web <raw>)"]
        assert series_labels(page, "source_loss") == ["step", "mixed loss EMA (pydocs)", "mixed loss EMA (wordnet)",
                                                      "mixed loss EMA (web <raw>)"]
        # The loss chart is the one it always was.
        assert series_labels(page) == ["step", "mixed loss", "mixed loss EMA", "mixed val loss", "mixed val loss (assistant)"]

        def series(chart, label):
            return page.evaluate("""([n, label]) => {
                const u = window.andreaDashboard.charts[n];
                return u.data[u.series.findIndex((s) => s.label === label)];
            }""", [chart, label])

        probs = series("mix", "mixed mix (pydocs)")
        assert probs[0] == 0.6 and probs[PIVOT - 1] == 0.6 and probs[PIVOT] == 0.2 and len(probs) == 70
        assert page.evaluate("[window.andreaDashboard.charts.mix.scales.y.min, window.andreaDashboard.charts.mix.scales.y.max]") == [0, 1]
        assert [v for v in series("val_sources", "mixed val loss (wordnet)") if v is not None] == [
            mixed_record(s)["val_loss_sources"]["wordnet"] for s in range(10, 71, 10)]
        noise = series("source_loss", "mixed loss EMA (web <raw>)")
        assert noise[:4] == [None] * 4 and None not in noise[4:]

        # A source keeps its colour on every chart; the sources' colours differ.
        strokes = page.evaluate("""() => Object.fromEntries(["mix", "val_sources", "source_loss"].map((n) =>
            [n, window.andreaDashboard.charts[n].series.slice(1).map((s) => s._stroke)]))""")
        assert strokes["mix"] == strokes["val_sources"] == strokes["source_loss"]
        assert len(set(strokes["mix"])) == 3

        # Each chart's key names its sources, in their colours (the name as text, not markup).
        key = page.locator("#chart-mix").locator("xpath=..").locator(".key.sources .source")
        assert key.all_inner_texts() == list(SOURCES)
        assert page.locator("#chart-val-sources").locator("xpath=..").locator(".key.sources .source").all_inner_texts() == list(SOURCES)

        # Phase boundaries on the new charts as on the others.
        page.wait_for_function("""(step) => ["chart-mix", "chart-val-sources", "chart-source-loss", "chart-lr"].every((id) => {
            const drawn = JSON.parse(document.getElementById(id).dataset.phases || "null");
            return drawn && drawn.length === 1 && drawn[0].x === step && drawn[0].to === "polish";
        })""", arg=PIVOT, timeout=10_000)

        # The read-out names each source, its probability and the sequences drawn.
        box = page.locator("#chart-mix .u-over").bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.95, box["y"] + box["height"] * 0.5)
        page.wait_for_selector("#tip", state="visible")
        tip = page.inner_text("#tip")
        assert "web <raw>" in tip and "0.20 · 4 seq" in tip and "polish" in tip

        # A second mixing run: the same colour for the same source, its own dash, and a key for the dashes.
        page.check("tr[data-run=other] input")
        page.wait_for_function("window.andreaDashboard.charts.mix.series.some((s) => s.label === 'other mix (pydocs)')",
                               timeout=10_000)
        stroke_of = """([n, label]) => {
            const s = window.andreaDashboard.charts[n].series.find((s) => s.label === label);
            return [s._stroke, JSON.stringify(s.dash || [])];
        }"""
        mine, other = (page.evaluate(stroke_of, ["val_sources", f"{r} val loss (pydocs)"]) for r in ("mixed", "other"))
        assert mine[0] == other[0] and mine[1] != other[1]
        assert page.locator("#chart-mix").locator("xpath=..").locator(".key.sources .run-dash").all_inner_texts() == [
            "mixed", "other"]
        page.uncheck("tr[data-run=other] input")

        # Overlaid with a run without sources: it adds no series to the per-source charts.
        page.check("tr[data-run=old] input")
        wait_points(page, "old loss", 40)
        assert series_labels(page, "mix") == ["step", "mixed mix (pydocs)", "mixed mix (wordnet)", "mixed mix (web <raw>)"]
        assert not page.locator("#chart-mix").locator("xpath=..").locator(".key.sources .run-dash").count()

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-sources.png"), full_page=True)

        # Only the run without sources: the per-source charts go away.
        page.uncheck("tr[data-run=mixed] input")
        page.wait_for_function("!window.andreaDashboard.charts.mix", timeout=10_000)
        assert source_charts_shown(page) == {"mix": False, "val_sources": False, "source_loss": False}

    # A run whose records have the mixture but no eval step yet: only the charts it has data for.
    results2 = tmp_path / "results2"
    results2.mkdir()
    early = [dict(mixed_record(s)) for s in range(1, 10)]
    (results2 / "early.loss.json").write_text("".join(json.dumps({k: v for k, v in rec.items() if k != "source_loss"}) + "\n"
                                                      for rec in early))
    with running(results2) as srv:
        page.goto(f"http://127.0.0.1:{srv.server_address[1]}/?poll=200#runs=early")
        wait_points(page, "early loss", 9)
        page.wait_for_function("!!window.andreaDashboard.charts.mix", timeout=10_000)
        assert source_charts_shown(page) == {"mix": True, "val_sources": False, "source_loss": False}


def table_fits(page):
    """The runs table's right edge against its container's and the page's: nothing cut off or scrolled."""
    return page.evaluate("""() => {
        const t = document.getElementById("runs"), box = t.parentElement.getBoundingClientRect();
        const style = getComputedStyle(t.parentElement);
        const ths = [...t.querySelectorAll("thead th")].filter((th) => th.offsetParent);
        return {table: t.getBoundingClientRect().right, room: box.right - parseFloat(style.paddingRight),
                last: ths[ths.length - 1].textContent, lastRight: ths[ths.length - 1].getBoundingClientRect().right,
                scroll: t.scrollWidth, client: t.clientWidth,
                page: document.documentElement.scrollWidth, view: document.documentElement.clientWidth};
    }""")


def test_page_lists_current_runs_shows_samples_and_fits_1400px(tmp_path, page):
    """By default only current runs (linked into results/, or running); superseded ones with the toggle or
    ?all=1. The table, with every optional column and long run ids, fits 1400 px. The newest samples of a
    plotted run are shown as text."""
    results = tmp_path / "results"
    results.mkdir()
    name = "ANDREA-120M-mixture-polish-with-a-long-experiment-name"
    lock = workflow_runs(results, long_name=name)
    (results / "two.loss.json").write_text(phased_lines(range(1, 71)))
    old, live = f"runs/{name}/old/{name}", f"runs/{name}/live/{name}"
    row = lambda run_id: page.locator(f'tr[data-run="{run_id}"]')  # noqa: E731
    try:
        with running(results) as srv:
            base = f"http://127.0.0.1:{srv.server_address[1]}/?poll=200"
            page.goto(f"{base}#runs={name},two,{live}")
            wait_points(page, "two loss", 70)
            page.wait_for_selector(f'#samples .sample-run[data-run="{name}"]', timeout=10_000)
            assert row(name).is_visible() and row(live).is_visible() and not row(old).is_visible()
            assert page.inner_text("#all-count") == "(1)" and "1 superseded hidden" in page.inner_text("#source")

            # The newest step's samples, as text: markup in a prompt or completion is not markup.
            panel = page.locator(f'#samples .sample-run[data-run="{name}"]')
            assert "step 2" in panel.locator("figcaption").inner_text()
            assert panel.locator(".prompt").all_inner_texts() == ["Say <b>hi</b> & bye", "2nd"]
            assert panel.locator(".completion").first.inner_text() == "<script>alert(1)</script>\nsecond line"
            assert page.locator("#samples b, #samples script").count() == 0
            assert page.locator("#samples .sample-run").count() == 1  # the other plotted runs have no samples

            for col in ("phase", "asst", "best"):
                assert page.is_visible(f"#runs th.opt-{col}"), col
            fit = table_fits(page)
            assert fit["last"] == "ETA" and fit["lastRight"] <= fit["room"] + 0.5, fit
            assert fit["table"] <= fit["room"] + 0.5 and fit["scroll"] <= fit["client"] and fit["page"] <= fit["view"], fit
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard-runs.png"), full_page=True)

            # The toggle lists the superseded run (and keeps that in the address); the table still fits.
            page.check("#all")
            page.wait_for_function(f"!document.querySelector('tr[data-run=\"{old}\"]').hidden", timeout=10_000)
            assert "all=1" in page.evaluate("location.hash")
            assert row(old).locator(".tag").is_visible() and not row(name).locator(".tag").is_visible()
            page.check(f'tr[data-run="{old}"] input')
            fit = table_fits(page)
            assert fit["lastRight"] <= fit["room"] + 0.5 and fit["page"] <= fit["view"], fit
            page.uncheck("#all")
            page.wait_for_function(f"document.querySelector('tr[data-run=\"{old}\"]').hidden", timeout=10_000)
            assert not any(label.startswith(old) for label in series_labels(page))

            # ?all=1 in the address lists them from the start.
            page.goto(f"{base}&all=1")
            page.wait_for_function(f"!!document.querySelector('tr[data-run=\"{old}\"]')", timeout=10_000)
            assert row(old).is_visible() and page.is_checked("#all")
    finally:
        lock.close()
