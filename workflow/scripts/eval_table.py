"""One HTML table of the `andrea eval` reports (format andrea-eval/1), one row per experiment."""

import json
import sys
from html import escape

from andrea.store.runfiles import unfinished_phrase

# (header, how to read it from an eval report, format)
COLUMNS = [
    ("experiment", lambda r: r["experiment"]["name"], "{}"),
    ("step", lambda r: r["checkpoint"]["step"], "{:,}"),
    ("parameters", lambda r: r["checkpoint"]["n_params"], "{:,}"),
    ("val loss", lambda r: r["metrics"]["val_loss"], "{:.4f}"),
    ("val loss, assistant tokens", lambda r: r["metrics"].get("val_loss_assistant"), "{:.4f}"),
    ("perplexity", lambda r: r["metrics"]["perplexity"], "{:.2f}"),
    ("bits/byte", lambda r: r["metrics"]["bits_per_byte"], "{:.4f}"),
    ("val tokens", lambda r: r["metrics"]["tokens"], "{:,}"),
    ("engine", lambda r: r["engine"], "{}"),
]

STYLE = """
body { font-family: sans-serif; margin: 1.5em; }
table { border-collapse: collapse; }
th, td { border-bottom: 1px solid #ddd; padding: 0.35em 0.9em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f4f4f4; }
"""


def cell(report: dict, read, fmt: str) -> str:
    value = read(report)
    return "n/a" if value is None else escape(fmt.format(value))


def render(reports: list[dict], states: list[dict] | None = None) -> str:
    head = "".join(f"<th>{escape(name)}</th>" for name, _, _ in COLUMNS) + "<th>checkpoint</th>"
    states = states or [{} for _ in reports]
    rows = "\n".join(
        "<tr>" + "".join(f"<td>{cell(r, read, fmt)}</td>" for _, read, fmt in COLUMNS)
        + f"<td>{escape(unfinished_phrase(s) or 'finished')}</td></tr>" for r, s in zip(reports, states)
    )
    notes = [f"{r['experiment']['name']}: {phrase}"
             for r, s in zip(reports, states) if (phrase := unfinished_phrase(s))]
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>ANDREA evaluation</title>'
        f"<style>{STYLE}</style></head><body>\n<h2>Evaluation on the validation split</h2>\n"
        + "".join(f"<p><b>Unfinished:</b> {escape(n)}</p>\n" for n in notes)
        + f"<table>\n<tr>{head}</tr>\n{rows}\n</table>\n</body></html>\n"
    )


def read_state(path: str) -> dict:
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def main(paths: list[str], out: str, state_paths: list[str] = ()) -> None:
    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    states = [read_state(p) for p in state_paths] or None
    with open(out, "w") as f:
        f.write(render(reports, states))
    print(f"{out}: {len(reports)} experiments", file=sys.stderr)


if __name__ == "__main__":
    sys.stderr = open(snakemake.log[0], "w")  # noqa: F821 (set by Snakemake's script directive)
    main(list(snakemake.input.metrics), snakemake.output.html, list(snakemake.input.states))  # noqa: F821
