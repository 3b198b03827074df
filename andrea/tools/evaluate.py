"""Validation loss — the one implementation, used by the training loop and by `andrea eval` — and
`andrea eval`: loss, perplexity and bits per byte of a checkpoint, with its lineage.

Bits per byte makes models with different tokenizers comparable: the total cross-entropy of the
evaluated target tokens, in bits, divided by the UTF-8 length of the text those tokens decode to.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from andrea.common.atomic import write_json_atomic
from andrea.store.checkpoint import read_finite_weights, read_header, read_state, state_path, vouches
from andrea.common.errors import AndreaError
from andrea.store.identity import check_tokenizer, data_fingerprint, record_mismatches
from andrea.common.hashing import sha256_file
from andrea.tools.inference import find_tokenizer, inference_engine, load_tokenizer
from andrea.tools.inspect_ckpt import experiment_for
from andrea.spec.layout import ParameterLayout
from andrea.store.loader import TokenWindows
from andrea.store.manifest import lineage, manifest_path, read_manifest, write_manifest
from andrea.schedule.model import Model

EVAL_FORMAT = "andrea-eval/1"
MAX_EXP_ARG = 709.0  # math.exp overflows float64 above this


def validation_losses(model, windows, n_batches: int, assistant: bool = False,
                      source: int | None = None) -> dict[str, float]:
    """{"val_loss": the mean cross-entropy over the targets of the validation windows} (docs/EVAL.md):
    windows.val_windows(n_batches x micro-batch), i.e. min(n_batches x B, W) windows evenly spaced over the split (over
    one source's val split with `source`), each once, so every source counts by its share of the tokens. With
    `assistant`, also "val_loss_assistant": over the targets the loss masks count (assistant content and its
    <|im_end|>), sum(w ce) / sum(w), a micro-batch without such a target adding nothing; both from one forward pass
    of each micro-batch."""
    B = model.micro_batch
    chosen = windows.val_windows(n_batches * B, source)
    sums = {"val_loss": [0.0, 0.0], **({"val_loss_assistant": [0.0, 0.0]} if assistant else {})}
    for first in range(0, len(chosen), B):
        rows = chosen[first: first + B]
        real = len(rows)
        rows = rows + rows[-1:] * (B - real)  # the model's micro-batch size; the padding rows weigh 0
        (x, y), = windows.micro_batches_of(rows, 1)
        every = None
        if real < B:
            every = np.zeros(y.shape, np.float32)
            every[:real] = 1
        sums["val_loss"][0] += model.forward(x, y, weights=every) * float(real * y.shape[1])
        sums["val_loss"][1] += float(real * y.shape[1])
        if assistant:
            weights = windows.micro_weights_of(rows, 1)[0]
            weights[real:] = 0
            w = float(weights.sum(dtype=np.float64))
            if w > 0:
                sums["val_loss_assistant"][0] += model.mean_loss(weights) * w
                sums["val_loss_assistant"][1] += w
    if assistant and sums["val_loss_assistant"][1] == 0:
        raise AndreaError(f"{windows.path}: the {len(chosen)} validation windows hold no assistant target; "
                          "raise intervals.eval_batches or check the loss masks")
    return {key: total / counted for key, (total, counted) in sums.items()}


def validation_loss(model, windows, n_batches: int, source: int | None = None) -> float:
    """validation_losses' "val_loss" alone."""
    return validation_losses(model, windows, n_batches, source=source)["val_loss"]


def source_validation_losses(model, windows, n_batches: int) -> dict[str, float]:
    """{source: validation_loss over its own val split} (min(n_batches x B, W_k) of its windows, evenly spaced) for a
    folder of several sources (those with at least one val window); {} for one source."""
    if len(windows.sources) < 2:
        return {}
    return {name: validation_loss(model, windows, n_batches, source=k)
            for k, name in enumerate(windows.sources) if windows.source_windows(k) > 0}


def evaluated_targets(windows, micro_batch: int, n_batches: int) -> list[np.ndarray]:
    """The target tokens validation_loss scores (none of the padding), in order, as pieces of consecutive text: the
    targets of adjacent windows of one source follow each other in its shard, so each run of them is one piece, which
    decodes as a stretch of the val shard's own text."""
    runs: list[list[int]] = []
    for w in windows.val_windows(n_batches * micro_batch):
        if runs and w == runs[-1][-1] + 1 and windows.window_source(w) == windows.window_source(w - 1):
            runs[-1].append(w)
        else:
            runs.append([w])
    return [windows.micro_batches_of(run, 1)[0][1].reshape(-1) for run in runs]


def bits_per_byte(mean_loss: float, n_tokens: int, n_bytes: int) -> float:
    """Total nats over the tokens, in bits, per UTF-8 byte of their decoded text."""
    return mean_loss * n_tokens / math.log(2) / n_bytes


def _file_record(path: Path) -> dict:
    """A file as the eval report names it: path, sha256 and, when a stage made it, its manifest's sha256."""
    record = {"path": str(path), "sha256": sha256_file(path)}
    if manifest_path(path).is_file():
        record["manifest_sha256"] = read_manifest(path)["sha256"]
    return record


def evaluate_checkpoint(experiment, ckpt, data_dir=None, *, tokenizer=None, engine: str = "auto",
                        n_batches: int | str | None = None, other_data: bool = False, unvouched: bool = False) -> dict:
    """Everything `andrea eval` writes, as one JSON-ready dict. All but `throughput` is deterministic. The data
    defaults to the folder the run's state records; a checkpoint the state does not vouch for (`unvouched`) or
    validation data other than the run's (`other_data`) is refused unless asked for, and the JSON says which."""
    ckpt = Path(ckpt)
    read_header(ckpt)  # a checkpoint at all, before anything else is read
    state = read_state(ckpt)
    ckpt_record = _file_record(ckpt)
    vouched = vouches(ckpt, state, ckpt_record["sha256"])
    if vouched is False and not unvouched:
        raise AndreaError(f"{ckpt}: sha256 {ckpt_record['sha256'][:16]}… is not a checkpoint {state_path(ckpt)} vouches "
                          "for (modified, damaged or of another run); pass --unvouched to evaluate it anyway")
    trained = (state or {}).get("data") or {}
    if data_dir is None:
        if not trained.get("dir"):
            raise AndreaError(f"{ckpt}: no .state.json records the data it was trained on; pass --data")
        data_dir = trained["dir"]
    data_dir = Path(data_dir)
    exp = experiment_for(ckpt, experiment)
    shape = exp.model
    if n_batches not in (None, "all") and n_batches < 1:
        raise AndreaError(f"--batches {n_batches} must be at least 1")
    val_path = data_dir / "val.bin"
    windows = TokenWindows(val_path, shape.seq_len, exp.seed, shape.vocab_size)
    B, W = exp.micro_batch_size, windows.n_windows
    if n_batches is None:  # as the training loop: min(eval_batches x B, W) windows
        n_batches = exp.intervals["eval_batches"]
    elif n_batches == "all":
        n_batches = -(-W // B)
    elif n_batches * B > W:  # distinct windows only: no window scored twice
        raise AndreaError(f"--batches {n_batches} asks for {n_batches * B:,} windows ({n_batches} micro-batches of "
                          f"{B}) but {val_path} has {W:,}; pass fewer batches, or --batches all to score each once")
    read = data_fingerprint(data_dir, windows.files)
    differs = record_mismatches({k: trained[k] for k in read if k in trained}, read) if trained else []
    if differs and not other_data:
        raise AndreaError(f"{ckpt}: was trained on {trained.get('dir')} but --data {data_dir} holds other validation "
                          f"data ({'; '.join(differs[:2])}); pass the data it was trained on, or --other-data to score "
                          "it on this data (the JSON says so)")
    tokenizer_path = find_tokenizer(data_dir, tokenizer)
    if tokenizer_path is not None and state is not None:
        check_tokenizer(ckpt, state, tokenizer_path, state_path(ckpt))
    chat = load_tokenizer(tokenizer_path) if tokenizer_path else None

    step, params = read_finite_weights(ckpt, ParameterLayout(shape), f"experiment {exp.name}")
    model = Model(inference_engine(engine, exp.precision), shape, exp.micro_batch_size, training=False)
    model.load_state(params)
    start = time.perf_counter()
    losses = validation_losses(model, windows, n_batches, assistant=windows.has_masks)
    loss, loss_assistant = losses["val_loss"], losses.get("val_loss_assistant")
    model.engine.synchronize()
    wall = time.perf_counter() - start
    per_source = source_validation_losses(model, windows, n_batches)  # not in the throughput: other windows
    if not math.isfinite(loss):
        raise AndreaError(f"{ckpt}: its validation loss on {val_path} is {loss} although its weights are finite "
                          "(the forward overflows); use an earlier checkpoint")

    n_windows = len(windows.val_windows(n_batches * model.micro_batch))
    pieces = evaluated_targets(windows, model.micro_batch, n_batches)
    n_tokens = sum(piece.size for piece in pieces)  # n_windows x seq_len: the scored targets, none of the padding
    n_bytes = sum(len(chat.decode(piece).encode("utf-8")) for piece in pieces) if chat else None
    return {
        "format": EVAL_FORMAT,
        "experiment": {"name": exp.name, "path": exp.path, "trajectory_hash": exp.trajectory_hash()},
        "checkpoint": {**ckpt_record, "step": step, "n_params": int(params.size),
                       "vouched_for_by_state": vouched},
        "data": {"val": {**(_file_record(val_path) if windows.files == [val_path] else  # sources without a union
                            {"path": str(val_path), "shards": [_file_record(s) for s in windows.files]}),
                         "tokens": int(windows.tokens.size), "windows": windows.n_windows},
                 "tokenizer": _file_record(tokenizer_path) if tokenizer_path else None},
        "trained_on": trained or None,
        # None: no state records the training data; False: --other-data scored data other than the run's
        "data_as_trained": (not differs) if trained else None,
        "tokens_per_source": _tokens_per_source(state, ckpt_record["sha256"]),
        "lineage": asdict(lineage(val_path)) if manifest_path(val_path).is_file() else None,
        "metrics": {
            "val_loss": loss,
            "val_loss_assistant": loss_assistant,  # assistant tokens only (the loss masks); None without masks
            "val_loss_sources": per_source,  # each source's val split, as the training loop's val_loss_sources
            "perplexity": math.exp(loss) if loss < MAX_EXP_ARG else None,  # JSON has no infinity
            "bits_per_byte": bits_per_byte(loss, n_tokens, n_bytes) if n_bytes else None,
            "tokens": int(n_tokens),
            "bytes": n_bytes,
            "batches": -(-n_windows // model.micro_batch),  # micro-batches run, the last padded where B doesn't divide
            "micro_batch": model.micro_batch,
            "seq_len": shape.seq_len,
            "distinct_windows": n_windows,  # each scored once; data.val.windows of them: the whole split
        },
        "engine": model.engine.name,
        "throughput": {"tokens_per_s": n_tokens / wall, "wall_s": wall},
    }


def _tokens_per_source(state: dict | None, sha256: str) -> dict | None:
    """The train tokens each source gave up to the checkpoint, from the .state.json entry that vouches for it."""
    for entry in (state or {}).get("checkpoints", []):
        if entry.get("sha256") == sha256 and "tokens_per_source" in entry:
            return entry["tokens_per_source"]
    return None


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="validation loss, perplexity and bits per byte of a checkpoint",
        description="Evaluate a checkpoint on DATA/val.bin exactly as the training loop does (same windows, "
        "micro-batch size and intervals.eval_batches), so the loss equals the val_loss logged at that step. "
        "Adds perplexity, bits per UTF-8 byte (needs DATA/tokenizer.json or --tokenizer), throughput and "
        "the lineage of the checkpoint and data. Writes JSON to --out.",
    )
    p.add_argument("--experiment", help="experiment JSON (default: the one in the checkpoint's .state.json)")
    p.add_argument("--ckpt", required=True, help="checkpoint, e.g. results/ANDREA-12M.ckpt")
    p.add_argument("--data", help="folder with val.bin (and tokenizer.json) (default: the data folder the checkpoint's "
                   ".state.json records)")
    p.add_argument("--out", required=True, help="JSON report to write, e.g. results/eval/ANDREA-12M.json")
    p.add_argument("--tokenizer", help="tokenizer.json for bits per byte (default: DATA/tokenizer.json)")
    p.add_argument("--batches", type=_batches, help="validation micro-batches, distinct windows evenly spaced over the "
                   "split, or `all`: every window once (default: the experiment's intervals.eval_batches)")
    p.add_argument("--engine", default="auto", choices=("auto", "numpy", "cuda"),
                   help="auto (default) uses CUDA when a device is present, else NumPy; the loss equals "
                   "training's when the engine is the one that trained")
    p.add_argument("--other-data", action="store_true",
                   help="score the checkpoint on --data although its validation files are not those it was trained "
                   "with (refused without it; the JSON's data_as_trained says false)")
    p.add_argument("--unvouched", action="store_true",
                   help="evaluate a checkpoint that its .state.json does not vouch for (refused without it; the "
                   "JSON's checkpoint.vouched_for_by_state says false)")
    p.set_defaults(func=main)


def _batches(value: str) -> int | str:
    """--batches: a number of micro-batches, or `all`."""
    if value == "all":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a number of micro-batches nor `all`") from None


def main(args) -> int:
    report = evaluate_checkpoint(args.experiment, args.ckpt, args.data, tokenizer=args.tokenizer,
                                 engine=args.engine, n_batches=args.batches, other_data=args.other_data,
                                 unvouched=args.unvouched)
    write_json_atomic(args.out, report)
    val = report["data"]["val"]
    inputs = [args.ckpt, *([val["path"]] if "shards" not in val else [s["path"] for s in val["shards"]])]
    if report["data"]["tokenizer"]:
        inputs.append(report["data"]["tokenizer"]["path"])
    write_manifest(
        args.out, stage="eval", inputs=inputs,
        config={"experiment": report["experiment"], "batches": report["metrics"]["batches"], "engine": report["engine"]},
        counts={"tokens": report["metrics"]["tokens"]}, wall_time_s=report["throughput"]["wall_s"],
    )
    m = report["metrics"]
    bpb = f"{m['bits_per_byte']:.4f}" if m["bits_per_byte"] is not None else "n/a (no tokenizer)"
    assistant = f" (assistant tokens {m['val_loss_assistant']:.6f})" if m["val_loss_assistant"] is not None else ""
    print(f"{report['experiment']['name']} step {report['checkpoint']['step']}: val_loss {m['val_loss']:.6f}{assistant}  "
          f"perplexity {m['perplexity'] or float('inf'):.3f}  bits/byte {bpb}  {m['tokens']:,} tokens  "
          f"{report['throughput']['tokens_per_s']:,.0f} tok/s -> {args.out}")
    return 0

