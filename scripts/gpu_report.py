"""Markdown tables for docs/PERFORMANCE.md from one bench.json (scripts/bench.py's output).

    python3 scripts/gpu_report.py results/bench/bench.json [--precisions bf16,tf32]

Per op: FLOPs and fewest bytes of one call, the floor they imply at the ceilings measured in the same
run (products at the precision's cuBLAS rate, bytes at the copy bandwidth), the measured time, and its
share of the step (time x calls per step over the sum of them all)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from andrea.schedule.timing import peer_pairs  # noqa: E402


def whole_step(report: dict) -> list[str]:
    rows = ["| shape | precision | ANDREA ms/step | tokens/s | peer | peer ms/step | peer tokens/s | ratio |",
            "|---|---|---:|---:|---|---:|---:|---:|"]
    for shape, precision, e, peer, base, counts in peer_pairs(report["bench"]):
        ratio = f"{e['tokens_per_s'] / base['tokens_per_s']:.2f}" if "tokens_per_s" in base else "-"
        ratio = f"**{ratio}** (the bar)" if counts else ratio
        rows.append(f"| {shape}, B={e['micro_batch']} | {precision} | {e['ms_per_step']:.2f} | {e['tokens_per_s']:,} | "
                    f"PyTorch {peer} | {base.get('ms_per_step', float('nan')):.2f} | {base.get('tokens_per_s', 0):,} | {ratio} |")
    return rows


def per_op(report: dict, key: str) -> list[str]:
    c = report["ceilings"]
    precision = key.split("/")[1]
    rate = c[f"{precision}_tflops"] * 1e12
    bw = c["copy_tb_s"] * 1e12
    ops = report["bench"]["ops"][key]
    total = sum(v["ms"] * v["calls_per_step"] for v in ops.values())
    rows = ["| op | calls/step | GFLOP | MB | floor ms | ms | TFLOP/s · TB/s | share of step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for op, v in ops.items():
        floor = max(v["gflop"] * 1e9 / rate, v["mbytes"] * 1e6 / bw) * 1e3
        rows.append(f"| {op} | {v['calls_per_step']} | {v['gflop']:,.3f} | {v['mbytes']:,.1f} | {floor:.3f} | {v['ms']:.3f} | "
                    f"{v['tflop_s']:.1f} · {v['tb_s']:.2f} | {100 * v['ms'] * v['calls_per_step'] / total:.0f}% |")
    rows.append(f"| sum (time x calls) | | | | | {total:.2f} | | |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path)
    parser.add_argument("--precisions", default="bf16")
    args = parser.parse_args()
    report = json.loads(args.report.read_text())
    if "engine" not in report.get("bench", {}) or "copy_tb_s" not in report.get("ceilings", {}):
        print(f"{args.report}: no bench and ceilings sections to tabulate; run scripts/bench.py with --sections ceilings,bench",
              file=sys.stderr)
        return 1
    print("\n".join(whole_step(report)))
    for key in report["bench"]["ops"]:
        if key.split("/")[1] in args.precisions.split(","):
            print(f"\n#### {key}\n")
            print("\n".join(per_op(report, key)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
