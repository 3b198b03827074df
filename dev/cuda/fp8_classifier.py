"""What FP8 products in the classifier do to precision fp8's loss, on the CPU.

    PYTHONPATH=. python3 dev/cuda/fp8_classifier.py [--text results/data/tokens-V4096] [--steps 200]
        [--width 128 --layers 2 --seq 64 --batch 8]

precision fp8 multiplies attn_qkv, the MLP and two of the classifier's three products (the tied output
projection: logits = x wte^T and the input gradient d_logits wte) on FP8 operands, and keeps wte's gradient
d_logits^T x in bf16 (on FP8 it would need a transposed copy of d_logits). Here the NumPy engine rounds as
andrea/engines/fp8_emulation.py does (current scaling, one power-of-two scale a tensor) and, in a third run, also
rounds wte's gradient's operands: d_logits to E5M2 and x to E4M3. Each run trains from the same init on the same
windows (real text, the held-out loss after the last step read from the validation shard; or, without --text, the
synthetic stream), and the script prints the final training and held-out losses and their distance from fp32. It
exits 1 when the third run ends more than 1.5% (the fp8 bar) from fp32 on the held-out loss (the training loss
without --text).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from andrea.config import ModelShape  # noqa: E402
from andrea.engines.crosscheck import held_out_micro_batches, text_micro_batches, train_run  # noqa: E402
from andrea.engines.fp8_emulation import Fp8EmulationEngine  # noqa: E402
from andrea.engines.numpy_engine import NumpyEngine  # noqa: E402
from andrea.shards import read_shard  # noqa: E402

LIMIT = 0.015


class Fp8Classifier(Fp8EmulationEngine):
    """The fp8 emulation with wte's gradient d_logits^T x on FP8 operands too (d_logits in E5M2 at its own scale, x in
    E4M3): all three of the classifier's products."""

    name = "numpy-fp8-classifier"

    def loss_bwd(self, *args, **kwargs):
        """NumpyOps.loss_bwd with its first product (wte's gradient) on rounded operands."""
        plain, calls = self.mm, []

        def mm(a, b, **kw):
            calls.append(1)
            if len(calls) > 1:
                return plain(a, b, **kw)
            return plain(self.fp8_operand(a, "e5m2"), self.fp8_operand(b, "e4m3"), **kw)
        self.mm = mm
        try:
            super().loss_bwd(*args, **kwargs)
        finally:
            self.mm = plain


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", type=Path, default=None,
                    help="a tokens folder (train.bin, val.bin, as `andrea tokenize` writes it); default: the synthetic "
                         "stream")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps of each run (default 200)")
    ap.add_argument("--width", type=int, default=128, help="d_model, heads of 16 (default 128)")
    ap.add_argument("--layers", type=int, default=2, help="n_layer (default 2)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocab_size, at least the tokenizer's (default 4096)")
    ap.add_argument("--seq", type=int, default=64, help="seq_len (default 64)")
    ap.add_argument("--batch", type=int, default=8, help="sequences a step (default 8)")
    args = ap.parse_args(argv)
    shape = ModelShape(n_layer=args.layers, d_model=args.width, n_head=args.width // 16, vocab_size=args.vocab,
                       seq_len=args.seq)
    run = dict(shape=shape, micro_batch=args.batch, n_micro=1, steps=args.steps)
    if args.text is not None:
        for name in ("train.bin", "val.bin"):
            if not (args.text / name).is_file():
                print(f"{args.text / name}: no such shard; give --text the folder `andrea tokenize` wrote "
                      "(e.g. results/data/tokens-V4096 after `snakemake --cores 8 results/data/tokens-V4096/val.bin`)",
                      file=sys.stderr)
                return 2
        train, val = read_shard(args.text / "train.bin"), read_shard(args.text / "val.bin")
        if max(int(train.max()), int(val.max())) >= args.vocab:
            print(f"{args.text}: token ids up to {max(int(train.max()), int(val.max()))} do not fit --vocab {args.vocab}",
                  file=sys.stderr)
            return 2
        run.update(held_out=held_out_micro_batches(val, args.seq, args.batch),
                   stream=lambda step: text_micro_batches(train, args.seq, args.batch, 1, step))
    results = {}
    for label, engine in (("fp32", NumpyEngine()), ("fp8 (as precision fp8)", Fp8EmulationEngine()),
                          ("fp8, dwte on FP8 too", Fp8Classifier())):
        t0 = time.time()
        r = train_run(engine, **run)
        results[label] = loss, held = r.losses[-1], r.held_out
        ref_train, ref_held = results["fp32"]
        line = f"{label:32} training loss {loss:.5f} ({(loss - ref_train) / ref_train:+.3%})"
        if held is not None:
            line += f", held-out {held:.5f} ({(held - ref_held) / ref_held:+.3%})"
        print(f"{line}  [{time.time() - t0:.0f} s]", flush=True)
    loss, held = results["fp8, dwte on FP8 too"]
    worst = abs(held - ref_held) / ref_held if held is not None else abs(loss - ref_train) / ref_train
    return 0 if worst <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
