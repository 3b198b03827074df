"""The report's loss curve (workflow/scripts/plot_loss.py): phases and both validation losses."""

import importlib.util
import json
import re
from pathlib import Path
from xml.etree import ElementTree

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "workflow" / "scripts" / "plot_loss.py"
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def plot_loss():
    spec = importlib.util.spec_from_file_location("plot_loss", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the Snakemake entry point stays behind its __main__ guard
    return module


def record(step, phased):
    rec = {"step": step, "loss": 6.0 - step / 20, "lr": 1e-3, "grad_norm": 1.0, "tokens": 512 * step,
           "tokens_per_s": 1000.0, "time": 0.5 * step}
    if step % 10 == 0:
        rec["val_loss"] = rec["loss"] - 0.1
        if phased:
            rec["val_loss_assistant"] = rec["loss"] - 0.6
    if phased:
        rec["phase"] = "main" if step <= 40 else "polish"
    return rec


def two_phase_history():
    out = [json.dumps({"event": "start", "wall": 0.0, "step": 0, "stop": 50, "total_steps": 50})]
    for step in range(1, 51):
        out.append(json.dumps(record(step, phased=True)))
        if step == 40:
            out.append(json.dumps({"event": "best", "step": 40, "val_loss": 3.4, "metric": "val_loss_assistant"}))
            out.append(json.dumps({"event": "pivot", "wall": 20.0, "step": 40, "from": "main", "to": "polish"}))
        if step == 20:  # what a full disk, a crash or another writer leaves among the records
            out += ["null", json.dumps(record(21, phased=True))[:25], "[1, 2]", "", "42"]
    return "\n".join(out) + "\n" + json.dumps(record(51, phased=True))[:30]  # torn last line


def texts(svg):
    return [t.text for t in ElementTree.fromstring(svg).iter(f"{SVG}text")]


def test_two_phases_draw_a_boundary_and_both_validation_losses(plot_loss, tmp_path, capsys):
    loss, svg_path = tmp_path / "two.loss.json", tmp_path / "two.loss.svg"
    loss.write_text(two_phase_history())
    plot_loss.main(str(loss), str(svg_path), "two: loss")
    svg = svg_path.read_text()
    root = ElementTree.fromstring(svg)  # well-formed
    labels = texts(svg)
    assert "validation, all tokens" in labels and "validation, assistant tokens" in labels
    assert "polish" in labels  # the boundary's label
    boundaries = [line for line in root.iter(f"{SVG}line") if line.get("stroke-dasharray")]
    assert len(boundaries) == 1 and "main → polish after step 40" in boundaries[0].find(f"{SVG}title").text
    x_step = {float(b.get("x1")) for b in boundaries}
    assert len(x_step) == 1 and 64 < x_step.pop() < 720 - 24
    assert len(re.findall(r'<circle [^>]*fill="white"', svg)) == 5  # the assistant-token measurements
    assert len(re.findall(r"<circle ", svg)) == 10
    assert "50 steps, 2 phases" in capsys.readouterr().err


def test_a_history_without_phases_still_plots(plot_loss, tmp_path):
    loss, svg_path = tmp_path / "old.loss.json", tmp_path / "old.loss.svg"
    loss.write_text(json.dumps({"event": "start", "wall": 0.0, "step": 0}) + "\n"
                    + "".join(json.dumps(record(s, phased=False)) + "\n" for s in range(1, 31)) + "null\n")
    plot_loss.main(str(loss), str(svg_path), "old: loss")
    svg = svg_path.read_text()
    root = ElementTree.fromstring(svg)
    labels = texts(svg)
    assert "train" in labels and "validation" in labels and "old: loss" in labels
    assert not any("assistant" in (t or "") for t in labels)
    assert not [line for line in root.iter(f"{SVG}line") if line.get("stroke-dasharray")]
    assert len(re.findall(r"<circle ", svg)) == 3


def test_a_real_two_phase_run_plots(plot_loss, tmp_path, tiny_experiment_raw, chat_data):
    from test_dashboard import REAL_MAIN, train_two_phase

    results = train_two_phase(tmp_path, tiny_experiment_raw, chat_data)
    svg_path = tmp_path / "tiny.loss.svg"
    plot_loss.main(str(results / "tiny.loss.json"), str(svg_path), "tiny: loss")
    svg = svg_path.read_text()
    labels = texts(svg)
    assert {"validation, all tokens", "validation, assistant tokens", "polish"} <= set(labels)
    assert f"main → polish after step {REAL_MAIN}" in svg


def test_a_history_without_records_is_refused(plot_loss, tmp_path):
    loss = tmp_path / "empty.loss.json"
    loss.write_text(json.dumps({"event": "start", "wall": 0.0, "step": 0}) + "\nnull\n")
    with pytest.raises(SystemExit, match="no step records"):
        plot_loss.main(str(loss), str(tmp_path / "empty.svg"), "empty")
