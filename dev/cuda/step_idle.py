"""How long the GPU idles in a benchmark step: the step's host time (scripts/bench.py's per_step_ms) minus its
micro-batch graph replayed back to back minus its optimizer (norm, AdamW, the weight copies) launched
back to back, each timed by device events over 20 runs.

    PYTHONPATH=. python3 dev/cuda/step_idle.py [--runs 12M/bf16,120M/bf16,120M/fp8,12M/fp8]

What is left is the host's part: its waits for the device and the launches after each. One line a run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import cupy  # noqa: E402

from bench import BENCH, EXPERIMENTS, options, per_step_ms  # noqa: E402


def events_ms(fn, n: int = 20) -> float:
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    fn()
    cupy.cuda.get_current_stream().synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / n


def bench_model(name: str, precision: str):
    """(engine, model) of scripts/bench.py's step for a shape and precision, from init seed 0."""
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.schedule.model import Model, init_params

    engine = CudaEngine(precision=precision)
    model = Model(engine, EXPERIMENTS[name].model, BENCH[name], graphs=True, **options(name))
    model.load_state(init_params(model.layout, 0))
    return engine, model


def optimizer_launches(engine, model):
    """A function launching a step's optimizer on the model's buffers, as train_step does after the micro-batches:
    the gradient's norm, AdamW (a tiny learning rate), the weight copies."""
    b, layout = model.buf, model.layout

    def optimizer():
        engine.grad_norm_partial(b["grad_norm_partials"], b["grads"], scale=0.5)
        engine.grad_norm_final(b["grad_norm"], b["grad_norm_partials"])
        engine.adamw_step(b["params"], b["grads"], b["m"], b["v"], lr=1e-9, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.1, step=5, decay_ranges=layout.decay_ranges(),
                          params_lp=b.get("params_lp"), grad_scales=(0.5, 1.0))
        model.weights_changed()
    return optimizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="12M/bf16,120M/bf16,120M/fp8,12M/fp8", help="shape/precision, comma-separated")
    args = ap.parse_args()
    for run in args.runs.split(","):
        name, precision = run.split("/")
        engine, model = bench_model(name, precision)
        step = per_step_ms(model, steps=23, warm=3)
        (graph,) = model.step_graphs
        replay = events_ms(lambda: engine.replay(graph))
        opt = events_ms(optimizer_launches(engine, model))
        print(f"{name} {precision}: step {step:.3f} ms; graph replay {replay:.3f}; optimizer {opt:.3f}; "
              f"idle {step - replay - opt:.3f}", flush=True)
        del model, engine
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
