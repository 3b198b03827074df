"""Time every cuBLASLt algorithm of the products in ANDREA's training steps; write the algorithm table.

    PYTHONPATH=. python3 scripts/tune_gemm.py [--shapes 12M,120M] [--precisions bf16] [--margin 0.03]
        [--out andrea/engines/cublaslt_algorithms.json]

One eager training step of each shape records the products it runs: the cuBLASLt ones (the MLP's GELU
epilogue products and the classifier's three in the 16-bit builds, the FP8 products under fp8) and the plain
ones the engine runs through cublasGemmEx unless the table names them (cuBLASLt can run them instead, leading
dimensions of their own included). Each product's algorithms (the heuristic's first HEURISTICS) are timed alone in a
CUDA graph on the step's own buffers; the fastest few and the baseline (the heuristic's first for a cuBLASLt
product, cublasGemmEx for a plain one) are then timed again, in turn, ROUNDS times, so that a drift of the
card's clock between the first timings does not decide; the table keeps the fastest where it beats the
baseline by more than --margin. A plain product the table names runs through cuBLASLt from then on
(Cublas.gemm). A gelu_aux product counts together with the "gelu" product the step runs on its algorithm
(the forward of a layer that recomputes its MLP): their sum decides.

The engine reads the table (andrea/engines/cublas.py, ALGORITHMS_FILE) for its GPU and cuBLASLt version
only, so a run takes the same algorithms every time: the choice is data made here, never a timing at run
time. The file keeps the tables of other GPUs and versions, and in this one's the products not measured
now. Run on a CUDA machine, then check and commit the file (`pytest -m gpu` and scripts/bench.py with it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from andrea.engines.cublas import ALGORITHMS_FILE, algorithm_table, merged_tables, product_name  # noqa: E402
from andrea.schedule.timing import graph_ms  # noqa: E402
from bench import BENCH, EXPERIMENTS, OPTIMIZER, lr_at, options, synthetic_micro_batches  # noqa: E402

FINALISTS = 3  # the fastest algorithms of the first timing that are timed again beside the baseline
ROUNDS = 3  # turns of timing them again; the median decides


def planned(kwargs: dict) -> dict:
    """A CublasLt.gemm call's keywords that decide its plan (not its scalars or device words, not an algorithm
    asked for)."""
    return {k: v for k, v in kwargs.items() if k not in ("alpha", "beta", "algo", "d_scale", "amax_d")}


def step_products(name: str, precision: str) -> tuple:
    """The engine and the products of one eager step: product name -> (kind, args, kwargs) of its first call,
    kind "lt" (a cuBLASLt call) or "plain" (a Cublas.gemm call, which cuBLASLt can run too)."""
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.schedule.model import Model, init_params

    engine = CudaEngine(precision=precision)
    lt, blas = engine.blas_lt, engine.blas
    if lt is None:
        raise SystemExit(f"precision {precision} runs no cuBLASLt product; choose a 16-bit one or fp8")
    calls: dict[str, tuple] = {}
    run_lt, run_plain = lt.gemm, blas.gemm

    def record_lt(*args, **kwargs):
        calls.setdefault(product_name(lt.plan_key(*args, **planned(kwargs))), ("lt", args, kwargs))
        return run_lt(*args, **kwargs)

    def record_plain(*args, **kwargs):
        calls.setdefault(product_name(lt.plan_key(*args, **planned(kwargs))), ("plain", args, kwargs))
        return blas.gemm_ex(*args, **kwargs)  # not through the table being remade

    lt.gemm, blas.gemm = record_lt, record_plain
    shape, micro = EXPERIMENTS[name].model, BENCH[name]
    model = Model(engine, shape, micro, graphs=False, **options(name))
    model.load_state(init_params(model.layout, 0))
    model.train_step(synthetic_micro_batches(shape, micro, 1, 0), step=0, lr=lr_at(0), optimizer=OPTIMIZER)
    lt.gemm, blas.gemm = run_lt, run_plain
    return engine, model, calls


def tune(engine, calls: dict[str, tuple], margin: float) -> tuple[dict, dict, dict]:
    """(choices, measured, baselines): the index kept for each product whose fastest algorithm beats its baseline,
    every algorithm's ms for each product (a gelu_aux product's with its "gelu" partner's added), and the plain
    products' cublasGemmEx ms."""
    lt = engine.blas_lt
    choices, measured, baselines = {}, {}, {}
    for pname, (kind, args, kwargs) in calls.items():
        if kwargs.get("epilogue") == "gelu":
            continue  # it runs on its gelu_aux product's algorithm: timed with it
        partner = None
        if kwargs.get("epilogue") == "gelu_aux":
            gelu = {**kwargs, "epilogue": "gelu"}
            partner = gelu if product_name(lt.plan_key(*args, **planned(gelu))) in calls else None

        def ms(i) -> float:  # i None: cublasGemmEx (a plain product's baseline)
            if i is None:
                return graph_ms(engine, lambda: engine.blas.gemm_ex(*args, **kwargs))
            t = graph_ms(engine, lambda: lt.gemm(*args, **{**kwargs, "algo": i}))
            if partner is not None:  # where "gelu" has no plan on this algorithm, the forward runs gelu_aux again
                ran = lt.plan_for(*args, **planned(partner), algo=i)[1] is not None
                t += graph_ms(engine, lambda: lt.gemm(*args, **{**partner, "algo": i})) if ran else t
            return t

        screened = [ms(i) for i in range(lt.algorithms(*args, **planned(kwargs)))]
        base = None if kind == "plain" else 0
        again = {base, *sorted(range(len(screened)), key=screened.__getitem__)[:FINALISTS]}
        rounds: dict = {i: [] for i in again}
        for _ in range(ROUNDS):
            for i in rounds:
                rounds[i].append(ms(i))
        final = {i: statistics.median(t) for i, t in rounds.items()}
        times = [round(final.get(i, t), 4) for i, t in enumerate(screened)]
        measured[pname] = times
        baseline = times[0] if base == 0 else round(final[None], 4)
        if kind == "plain":
            baselines[pname] = baseline
        if times:
            best = min(range(len(times)), key=times.__getitem__)
            if times[best] < (1 - margin) * baseline:
                choices[pname] = best
        print(f"{kind} {pname}: {' '.join(f'{t:.4f}' for t in times)} ms against {baseline:.4f} -> "
              f"{choices.get(pname, '-')}", flush=True)
    return choices, measured, baselines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shapes", default="12M,120M", help="comma-separated: 12M, 120M (default both)")
    ap.add_argument("--precisions", default="bf16", help="comma-separated precisions (default bf16)")
    ap.add_argument("--margin", type=float, default=0.03,
                    help="keep an algorithm only where it is this much faster than its baseline (default 0.03)")
    ap.add_argument("--out", type=Path, default=ALGORITHMS_FILE, help=f"the table file (default {ALGORITHMS_FILE})")
    args = ap.parse_args()
    shapes, precisions = args.shapes.split(","), args.precisions.split(",")
    for bad in set(shapes) - set(BENCH):
        ap.error(f"--shapes: unknown shape {bad!r}; choose from {', '.join(BENCH)}")
    tables = json.loads(args.out.read_text())["tables"] if args.out.is_file() else []
    for name in shapes:
        for precision in precisions:
            engine, model, calls = step_products(name, precision)
            print(f"{name}/{precision}: {len(calls)} products", flush=True)
            choices, measured, baselines = tune(engine, calls, args.margin)
            # a product measured again (the classifier's run in bf16 under fp8 too): the last measurement counts
            device, version = engine.blas_lt.device, engine.blas_lt.version
            tables = merged_tables(tables, device, version, args.margin, choices, measured, baselines)
            print(f"{name}/{precision}: {len(choices)} of its {len(measured)} products take another algorithm",
                  flush=True)
            del model, engine
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tables": tables}, indent=1) + "\n")
    print(f"{args.out}: {len(algorithm_table(tables, device, version))} products take another algorithm on {device}, "
          f"cuBLASLt {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
