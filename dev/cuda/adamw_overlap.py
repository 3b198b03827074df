"""What AdamW would cost beside the next step's forward: a step's update and its next micro-batch recorded in one
graph two ways, timed by device events.

    PYTHONPATH=. python3 dev/cuda/adamw_overlap.py [--shape 120M] [--precision bf16] [--rounds 5] [--reps 50]

serial:  the gradient's norm and gate, AdamW over the whole vector, the weight copies, then the micro-batch's
         forward and backward (what train_step and the next step's first micro-batch launch today).
overlap: the same launches; AdamW of wte, wpe and LNf first, then each layer's AdamW and weight copy on a second
         stream, in layer order, and layer l's forward waits only for its own (an event before attn_qkv_fwd);
         `--side-blocks` grids for the side stream's updates (few blocks leave most SMs to the forward's products).

The two graphs launch the same kernels on the same buffers; only their order differs, so the difference is what
running the memory-bound update beside the products' forward would save on this card (an upper bound: the real
step also holds the host's gaps). The update's numbers are those of a step with a tiny learning rate, so the
weights stay finite over the replays. bf16 and fp16 only (under fp8 the weights' casts read the whole update's amax).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

from bench import BENCH, OPTIMIZER, per_step_ms  # noqa: E402
from step_idle import bench_model  # noqa: E402

from andrea.ops.attn_qkv import QKV_ROWS_THREADS  # noqa: E402
from andrea.ops.base import ELEMENTWISE_THREADS, blocks  # noqa: E402

LEAST_PRIORITY, GREATEST_PRIORITY = 0, -5  # cudaDeviceGetStreamPriorityRange's on Ampere and Hopper (CUDA clamps)


def update_launcher(engine, model):
    """adam(lo, hi): k_adamw over params[lo:hi] (the decay ranges shifted into it), as adamw_step launches it
    over the whole vector; qkv_rows(l): layer l's W_QKV copied into its rows, as prepare_qkv_rows does for all."""
    b = model.buf
    ranges = model.layout.decay_ranges()
    tables = {}

    def table(lo, hi):
        if (lo, hi) not in tables:
            inside = [(max(s, lo) - lo, min(e, hi) - lo) for s, e in ranges if s < hi and e > lo]
            arr = cupy.zeros(max(2, 2 * len(inside)), dtype=np.int64)
            if inside:
                arr[:2 * len(inside)] = cupy.asarray(np.array(inside, dtype=np.int64).reshape(-1))
            tables[lo, hi] = (arr, len(inside))
        return tables[lo, hi]

    f32 = np.float32
    beta1, beta2 = OPTIMIZER["betas"]

    def adam(lo, hi, grid=0):
        """grid: the blocks (k_adamw strides over the rest); 0, one a 4 x 256 elements as adamw_step launches."""
        t, n = table(lo, hi)
        p, g, m, v, lp = (b[k][lo:hi] for k in ("params", "grads", "m", "v", "params_lp"))
        engine._launch("k_adamw", grid or blocks(-(-(hi - lo) // 4), ELEMENTWISE_THREADS), ELEMENTWISE_THREADS,
                       p, g, m, v, np.int64(hi - lo), t, np.int32(n), f32(1e-9), f32(beta1), f32(1 - beta1),
                       f32(beta2), f32(1 - beta2), f32(OPTIMIZER["eps"]), f32(OPTIMIZER["weight_decay"]),
                       f32(1 - beta1**5), f32(1 - beta2**5), lp, np.int32(1), f32(0.5), f32(1.0), b["grad_gate"],
                       np.uint64(0), np.int32(0), np.int32(1))

    def qkv_rows(l):
        if "w_qkv_rows" not in b:
            return
        W = model.W["layers"][l]["W_QKV"]
        C = W.shape[-1]
        engine._launch("k_qkv_rows", blocks(3 * C, QKV_ROWS_THREADS // 32), QKV_ROWS_THREADS,
                       b["w_qkv_rows"][l:l + 1], W, np.int64(0), np.int32(1), np.int32(C))

    return adam, qkv_rows, table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="120M", choices=("120M", "12M"))
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50, help="replays a round, each timed (default 50)")
    ap.add_argument("--side-blocks", default="0,16,32,66",
                    help="the side stream's AdamW grids to try, comma-separated (0: adamw_step's, a block a "
                         "1,024 elements; else that many blocks striding, leaving the other SMs to the forward)")
    args = ap.parse_args()
    engine, model = bench_model(args.shape, args.precision)
    lay, b, L = model.layout, model.buf, model.shape.n_layer
    step_ms = per_step_ms(model)  # also leaves a step's gradient, norm and gate in the buffers
    print(f"{args.shape} {args.precision} B {BENCH[args.shape]}: train_step {step_ms:.3f} ms", flush=True)
    adam, qkv_rows, table = update_launcher(engine, model)
    spans = [(0, lay.span("wte", "wpe").stop)] + [(lay.layer_span(l).start, lay.layer_span(l).stop) for l in range(L)]
    spans.append((lay.span("LNf.gamma", "LNf.beta").start, lay.n_params))
    for s in spans + [(0, lay.n_params)]:
        table(*s)  # uploaded before any capture

    def norm_gate():
        engine.grad_norm_partial(b["grad_norm_partials"], b["grads"], scale=0.5)
        engine.grad_norm_final(b["grad_norm"], b["grad_norm_partials"])
        engine.grad_gate(b["grad_gate"], b["grad_norm"], 1, OPTIMIZER["grad_clip"])

    def micro_batch():
        with model._pass():
            model._forward_ops(backward=True, first=True)
            model._backward(False, True)

    def serial():
        norm_gate()
        adam(0, lay.n_params)
        for l in range(L):
            qkv_rows(l)
        micro_batch()

    side = cupy.cuda.Stream(non_blocking=True, priority=LEAST_PRIORITY)
    fork = cupy.cuda.Event(disable_timing=True)
    done = [cupy.cuda.Event(disable_timing=True) for _ in range(L)]
    forward_qkv = engine.attn_qkv_fwd

    def overlap(grid):
        norm_gate()
        main_stream = cupy.cuda.get_current_stream()
        adam(*spans[0])
        adam(*spans[-1])
        fork.record(main_stream)
        side.wait_event(fork)
        with side:
            for l in range(L):
                adam(*spans[1 + l], grid=grid if l else 0)  # layer 0's, which the forward waits for first, whole
                qkv_rows(l)
                done[l].record(side)
        calls = iter(range(L))

        def waiting_qkv(*a, **k):
            cupy.cuda.get_current_stream().wait_event(done[next(calls)])
            return forward_qkv(*a, **k)
        engine.attn_qkv_fwd = waiting_qkv
        try:
            micro_batch()
        finally:
            del engine.attn_qkv_fwd

    graphs = {"serial": engine.capture(serial)}
    for grid in (int(x) for x in args.side_blocks.split(",")):
        graphs[f"overlap/{grid or 'full'}"] = engine.capture(lambda: overlap(grid))
        # the forward recorded on a stream of CUDA's highest priority, the side stream at the lowest: a kernel
        # node keeps its stream's priority, so the products' blocks go to SMs before the update's waiting ones
        graphs[f"overlap/{grid or 'full'}/prio"] = engine.capture(lambda: overlap(grid), priority=GREATEST_PRIORITY)
    times = {k: [] for k in graphs}

    def timed(name, reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        out = []
        for _ in range(reps):
            start.record()
            engine.replay(graphs[name])
            end.record()
            end.synchronize()
            out.append(cupy.cuda.get_elapsed_time(start, end))
        return out

    for name in graphs:
        timed(name, 5)
    for r in range(args.rounds):
        for name in graphs:
            t = timed(name, args.reps)
            times[name] += t
            print(f"round {r} {name}: {statistics.median(t):.3f} ms (min {min(t):.3f})", flush=True)
    for name in graphs:
        print(f"{name}: median {statistics.median(times[name]):.3f} ms over {len(times[name])}", flush=True)
    base = statistics.median(times["serial"])
    for name in graphs:
        if name != "serial":
            saved = base - statistics.median(times[name])
            print(f"{name} saves {saved:.3f} ms a step ({saved / base * 100:.1f}%)")
    if not np.isfinite(engine.to_host(b["params"])).all():
        raise SystemExit("the weights went non-finite over the replays: the times above are not a step's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
