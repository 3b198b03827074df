"""Loss curve of one training run as a standalone SVG (train loss per step, validation loss where
measured: over all target tokens, and over assistant tokens when the data has loss masks), with a
dashed, labelled line where each training phase ends (the history's `pivot` events). Plain SVG text:
the report needs no plotting library."""

import math
import sys
from html import escape

from andrea.store.runfiles import iter_records, read_loss_history, unfinished_phrase

WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 64, 24, 44, 52
TRAIN_COLOUR, VAL_COLOUR, ASSISTANT_COLOUR, PHASE_COLOUR = "#1f77b4", "#ff7f0e", "#2ca02c", "#555555"


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_pivots(path) -> list[dict]:
    """The history's phase changes, one per step (a pivot written again after a resume wins), in order."""
    by_step = {}
    for rec in iter_records(path):
        if rec.get("event") == "pivot" and isinstance(rec.get("step"), int) and isinstance(rec.get("to"), str):
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten) covering [lo, hi]."""
    raw = (hi - lo) / count or 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def render(title: str, records: list[dict], pivots: list[dict] = ()) -> str:
    steps = [r["step"] for r in records]
    train = [(r["step"], r["loss"]) for r in records if is_number(r.get("loss"))]
    val = [(r["step"], r["val_loss"]) for r in records if is_number(r.get("val_loss"))]
    assistant = [(r["step"], r["val_loss_assistant"]) for r in records if is_number(r.get("val_loss_assistant"))]
    losses = [loss for _, loss in train + val + assistant] or [0.0]
    x_lo, x_hi = 0, max(max(steps), 1)
    pivots = [p for p in pivots if x_lo <= p["step"] <= x_hi]
    y_lo, y_hi = min(losses), max(losses)
    pad = (y_hi - y_lo) * 0.05 or 0.5
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def x(step):
        return LEFT + (step - x_lo) / (x_hi - x_lo) * (WIDTH - LEFT - RIGHT)

    def y(loss):
        return HEIGHT - BOTTOM - (loss - y_lo) / (y_hi - y_lo) * (HEIGHT - TOP - BOTTOM)

    def polyline(points, colour):
        coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
        return f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.5"/>'

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" font-size="15">{escape(title)}</text>',
    ]
    for t in nice_ticks(x_lo, x_hi):
        out.append(f'<line x1="{x(t):.1f}" y1="{TOP}" x2="{x(t):.1f}" y2="{HEIGHT - BOTTOM}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{x(t):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{t:g}</text>')
    for t in nice_ticks(y_lo, y_hi):
        out.append(f'<line x1="{LEFT}" y1="{y(t):.1f}" x2="{WIDTH - RIGHT}" y2="{y(t):.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    out.append(
        f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" '
        'fill="none" stroke="#444"/>'
    )
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 12}" text-anchor="middle">optimizer step</text>')
    out.append(
        f'<text transform="translate(16 {(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" '
        'text-anchor="middle">cross-entropy loss (nats/token)</text>'
    )
    for p in pivots:  # where a phase ends: the next one's name above the frame, beside the line
        px = x(p["step"])
        right = px + 4 + 7 * len(p["to"]) > WIDTH - RIGHT  # the name would run past the frame: left of the line
        name = escape(p["to"])
        what = escape(f"{p['from']} → {p['to']}" if isinstance(p.get("from"), str) else p["to"])
        out.append(f'<line x1="{px:.1f}" y1="{TOP}" x2="{px:.1f}" y2="{HEIGHT - BOTTOM}" stroke="{PHASE_COLOUR}" '
                   f'stroke-width="1.2" stroke-dasharray="6 4"><title>{what} after step {p["step"]}</title></line>')
        out.append(f'<text x="{px + (-4 if right else 4):.1f}" y="{TOP - 6}" text-anchor="{"end" if right else "start"}" '
                   f'fill="{PHASE_COLOUR}" font-size="11">{name}</text>')
    if train:
        out.append(polyline(train, TRAIN_COLOUR))
    if val:
        out.append(polyline(val, VAL_COLOUR))
        out.extend(f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3" fill="{VAL_COLOUR}"/>' for s, v in val)
    if assistant:
        out.append(polyline(assistant, ASSISTANT_COLOUR))
        out.extend(f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3" fill="white" stroke="{ASSISTANT_COLOUR}" '
                   'stroke-width="1.5"/>' for s, v in assistant)
    legend = [("train", TRAIN_COLOUR)]
    if val:
        legend.append(("validation, all tokens" if assistant else "validation", VAL_COLOUR))
    if assistant:
        legend.append(("validation, assistant tokens", ASSISTANT_COLOUR))
    key = max(110, round(max(len(name) for name, _ in legend) * 6.5 + 36))  # the legend's width
    if pivots:  # a boundary line may cross the legend
        out.append(f'<rect x="{WIDTH - RIGHT - key - 6}" y="{TOP + 4}" width="{key}" height="{18 * len(legend) + 6}" '
                   'fill="white" fill-opacity="0.85"/>')
    for i, (name, colour) in enumerate(legend):
        ly = TOP + 16 + 18 * i
        out.append(f'<line x1="{WIDTH - RIGHT - key}" y1="{ly}" x2="{WIDTH - RIGHT - key + 24}" y2="{ly}" '
                   f'stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{WIDTH - RIGHT - key + 30}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def read_state(path) -> dict:
    import json

    try:
        state = json.loads(open(path).read())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def main(loss_path: str, svg_path: str, title: str) -> None:
    records = read_loss_history(loss_path)
    if not records:
        raise SystemExit(f"{loss_path}: no step records; the training run wrote no loss yet")
    pivots = read_pivots(loss_path)
    with open(svg_path, "w") as f:
        f.write(render(title, records, pivots))
    phases = f", {len(pivots) + 1} phases" if pivots else ""
    print(f"{svg_path}: {len(records)} steps{phases}", file=sys.stderr)


if __name__ == "__main__":
    sys.stderr = open(snakemake.log[0], "w")  # noqa: F821 (set by Snakemake's script directive)
    note = unfinished_phrase(read_state(snakemake.input.state))  # noqa: F821
    main(snakemake.input.loss, snakemake.output.svg,  # noqa: F821
         f"{snakemake.wildcards.experiment}: loss" + (f" ({note})" if note else ""))  # noqa: F821
