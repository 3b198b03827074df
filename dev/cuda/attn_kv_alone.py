"""The attention backward's dK/dV kernel alone, for kernel files side by side: three medians of 20 runs each.

    PYTHONPATH=. python3 dev/cuda/attn_kv_alone.py [--source PATH ...]

Each file (default: kernels/attn_bf16.cu and dev/cuda/attn_bf16_ds.cu) is built as attn_bf16_check.py builds it,
as the mma build and as the sm_90a warpgroup build, and its dK/dV kernel is timed at B8 T1024 H12 and B32 T512 H6
after a forward and the D its backward reads. A file that keeps dS (attn_bf16_ds.cu) is timed twice: writing its
dS pairs, and with a null pair pointer (the same kernel, storing nothing): what the stores cost, and what the kernel
costs against the shipped one when it stores nothing. Timings only; attn_bf16_check.py checks the results.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import attn_bf16_check as check  # noqa: E402
from andrea.timing import median_ms  # noqa: E402

SHAPES = ((8, 1024, 12), (32, 512, 6))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", action="append", metavar="PATH",
                    help="kernel file (repeatable; default kernels/attn_bf16.cu and dev/cuda/attn_bf16_ds.cu)")
    args = ap.parse_args()
    import cupy as cp

    sources = args.source or ["kernels/attn_bf16.cu", "dev/cuda/attn_bf16_ds.cu"]
    texts = {path: check.source_text(path)[1] for path in sources}
    for B, T, H in SHAPES:
        d = check.bench_arrays(cp, B, T, H)
        for hopper in (False, True):
            for path, text in texts.items():
                attn = check.Attn(cp, text, (), hopper=hopper)
                attn.fwd(d["out"], d["lse"], d["qkv"], B, T, H)
                if attn.ds_path:
                    attn._delta(d["delta"], d["dout"], d["out"], B, T, H)
                else:
                    attn.bwd_dq(d["dqkv"], d["delta"], d["dout"], d["out"], d["qkv"], d["lse"], B, T, H)
                for stores in ((True, False) if attn.ds_path else (True,)):
                    def run(a=attn, pairs=stores):
                        a.bwd_kv(d["dqkv"], d["delta"], d["dout"], d["qkv"], d["lse"], B, T, H, pairs=pairs)
                    ms = [median_ms(run, 20, 5) for _ in range(3)]
                    label = path + ("" if stores else ", null pairs")
                    print(f"B{B} T{T} H{H} {'wg ' if hopper else 'mma'} {label}: dK/dV {min(ms):.4f} ms "
                          f"({', '.join(f'{x:.4f}' for x in ms)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
