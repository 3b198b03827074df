"""Subcommands of the data stages: pull-hermes3 -> prep-megachat -> train-tokenizer -> tokenize,
and lineage. Stage modules are imported inside the commands so `andrea --help` stays instant."""

from __future__ import annotations

import argparse
import os
import sys

from andrea.data import HERMES3_DATASET
from andrea.data.chatml import MAX_TOKEN_LENGTH, UNSPACED_CHUNK


def _dropped(reasons: dict) -> str:
    """`3 (bad_role 2, empty 1)`: a drop count with its reasons, most first."""
    total = sum(reasons.values())
    detail = ", ".join(f"{why} {n:,}" for why, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{total:,}" + (f" ({detail})" if detail else "")


def summary(line: str) -> None:
    """What a stage did, in one line on stdout (its progress goes to stderr): the workflow shows it."""
    print(line, file=sys.stdout, flush=True)


def _pull(args) -> int:
    from andrea.data.pull_hermes3 import pull_hermes3

    manifest = pull_hermes3(args.source, args.out, revision=args.revision, hub_id=args.hub_id)
    counts = manifest["counts"]
    summary(f"pull-hermes3 {args.source}: {counts['rows_out']:,} conversations kept of {counts['rows_in']:,}, "
            f"dropped {_dropped(manifest.get('dropped', {}))}")
    return 0


def _prep(args) -> int:
    from andrea.data.prep_megachat import prep_megachat

    manifests = prep_megachat(args.input, args.out_dir, val_fraction=args.val_fraction)
    manifest = manifests["train"]  # both splits' manifests hold the stage's counts
    counts = manifest["counts"]
    summary(f"prep-megachat {args.out_dir}: {counts['train_rows']:,} train and {counts['val_rows']:,} val rows of "
            f"{counts['rows_in']:,}, dropped {_dropped(manifest.get('dropped', {}))} rows and "
            f"{_dropped(manifest.get('dropped_turns', {}))} turns")
    return 0


def _train_tokenizer(args) -> int:
    from andrea.data.train_tokenizer import train_tokenizer

    args.input = args.input or ["results/data/megachat/train.parquet"]
    manifest = train_tokenizer(args.input, args.vocab_size, args.out, min_frequency=args.min_frequency,
                               max_token_length=args.max_token_length, unspaced_chunk=args.unspaced_chunk,
                               threads=args.threads)
    counts = manifest["counts"]
    summary(f"train-tokenizer {args.out}: {counts['vocab_size']:,} tokens from {counts['rows']:,} conversations "
            f"({counts['content_bytes'] / 1e6:,.1f} MB of text)")
    return 0


def _tokenize(args) -> int:
    from andrea.data.tokenize_shards import tokenize
    from andrea.common.errors import AndreaError

    sources = None
    if args.source:
        sources = {}
        for spec in args.source:
            name, sep, folder = spec.partition("=")
            if not sep or not name or not folder:
                raise AndreaError(f"--source {spec}: write it as NAME=MEGACHAT_DIR")
            if name in sources:
                raise AndreaError(f"--source {name} is given twice; each source needs a name of its own")
            sources[name] = folder
    in_dir = args.in_dir if args.in_dir or sources else "results/data/megachat"
    manifests = tokenize(args.tokenizer, in_dir, args.out_dir, threads=args.threads, sources=sources)
    summary(f"tokenize {args.out_dir}: " + ", ".join(
        f"{split} {m['counts']['tokens']:,} tokens ({m['counts']['target_tokens']:,} assistant targets)"
        for split, m in manifests.items()) + (f", from {len(sources)} sources" if sources else ""))
    return 0


def _lineage(args) -> int:
    import json
    from dataclasses import asdict

    from andrea.store.manifest import format_lineage, lineage, lineage_ok

    root = lineage(args.file)
    print(json.dumps(asdict(root), indent=2) if args.json else "\n".join(format_lineage(root)))
    return 0 if lineage_ok(root) else 1


def register(subparsers) -> None:
    fmt = argparse.ArgumentDefaultsHelpFormatter

    p = subparsers.add_parser(
        "pull-hermes3", formatter_class=fmt,
        help="pull raw chats into one Hermes-3 parquet (Hub, embedded corpus or local file)",
        description="Pull raw chat data into a parquet file in the Hermes-3 schema "
        "(conversations: [{from, value, weight}], plus a source column), every text exactly as the source holds "
        "it; a record that cannot be one is counted with its line in the manifest. --source embedded (the "
        "default) needs no network: a corpus shipped in the package (Python's documentation, WordNet).",
    )
    p.add_argument("--source", default="embedded", metavar="hub|embedded[:DOMAIN]|PATH",
                   help="`hub`: the train split of --hub-id, streamed (HF_TOKEN, HF_HUB_OFFLINE are honoured); "
                   "`embedded`: every domain of the packaged corpus, `embedded:DOMAIN` one of them; PATH: a local "
                   ".json, .jsonl (optionally .gz) or .parquet file in the Hermes-3 or OpenAI "
                   "(messages: [{role, content}]) schema")
    p.add_argument("--out", default="results/data/hermes3.parquet", help="output parquet")
    p.add_argument("--revision", help="Hub branch, tag or commit for --source hub (None: main); "
                   "the manifest records the commit it resolves to")
    p.add_argument("--hub-id", default=HERMES3_DATASET,
                   help="Hub dataset id for --source hub, or a local clone of a Hub dataset repo")
    p.set_defaults(func=_pull)

    p = subparsers.add_parser(
        "prep-megachat", formatter_class=fmt,
        help="clean, deduplicate and split chats into MegaChat train/val parquet",
        description="Turn pulled chats (Hermes-3 or OpenAI schema, mixed rows allowed) into MegaChat: "
        "ChatML roles, NFC and whitespace normalisation, malformed rows dropped and counted by reason, "
        "duplicates dropped by content hash, a train/val split by hash. Writes OUT_DIR/train.parquet and "
        "OUT_DIR/val.parquet with columns id, source, n_turns, text (ChatML), turns.",
    )
    p.add_argument("--in", dest="input", default="results/data/hermes3.parquet", help="pulled parquet")
    p.add_argument("--out-dir", default="results/data/megachat", help="folder for train.parquet and val.parquet")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of conversations put in val, in [0, 1)")
    p.set_defaults(func=_prep)

    p = subparsers.add_parser(
        "train-tokenizer", formatter_class=fmt,
        help="train a byte-level BPE tokenizer with the ChatML special tokens",
        description="Train a byte-level BPE tokenizer (tokenizers) on MegaChat train text. Special tokens "
        "<|endoftext|>, <|im_start|>, <|im_end|> get ids 0, 1, 2. Deterministic for the same input. "
        "Put it in the folder tokenize writes to: training reads tokenizer.json next to the shards.",
    )
    p.add_argument("--in", dest="input", action="append", metavar="PARQUET",
                   help="MegaChat train parquet; repeat it to train on the union of several sources' train splits "
                   "(default: results/data/megachat/train.parquet)")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokens including the 3 special ones; at most 65536")
    p.add_argument("--min-frequency", type=int, default=2, help="fewest occurrences for a pair to be merged")
    p.add_argument("--max-token-length", type=int, default=MAX_TOKEN_LENGTH,
                   help="longest token, in bytes (characters of the byte-level alphabet)")
    p.add_argument("--unspaced-chunk", type=int, default=UNSPACED_CHUNK,
                   help="characters per word for scripts written without spaces (CJK, kana, Hangul, Thai, ...)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="training threads")
    p.add_argument("--out", default="results/data/tokens-V4096/tokenizer.json", help="output tokenizer.json")
    p.set_defaults(func=_train_tokenizer)

    p = subparsers.add_parser(
        "tokenize", formatter_class=fmt,
        help="encode MegaChat train/val into llm.c token shards",
        description="Encode every MegaChat conversation as ChatML token ids, each followed by <|endoftext|>, "
        "into OUT_DIR/train.bin and OUT_DIR/val.bin (llm.c shards: 256 x int32 header, uint16 tokens) with "
        "their loss masks (train.mask.bin, val.mask.bin); with --source, per source into OUT_DIR/NAME/ and "
        "their union into OUT_DIR. The tokenizer must be OUT_DIR/tokenizer.json, so training finds it beside them.",
    )
    p.add_argument("--tokenizer", default="results/data/tokens-V4096/tokenizer.json", help="tokenizer.json")
    p.add_argument("--in-dir", help="one source: folder with train.parquet and val.parquet "
                   "(default: results/data/megachat)")
    p.add_argument("--source", action="append", metavar="NAME=DIR",
                   help="a source's MegaChat folder; repeat for several: each is written to OUT_DIR/NAME/, "
                   "their union to OUT_DIR")
    p.add_argument("--out-dir", default="results/data/tokens-V4096", help="folder for train.bin and val.bin")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="parallel encoders (worker processes: encoding holds the GIL); "
                   "the output does not depend on it")
    p.set_defaults(func=_tokenize)

    p = subparsers.add_parser(
        "lineage", formatter_class=fmt,
        help="print an artifact's chain of manifests back to the raw pull",
        description="Follow FILE's manifest and its inputs' manifests back to the raw pull, checking each "
        "file's sha256: ok, modified (bytes differ from the manifest), stale (rebuilt after its consumer "
        "read it) or missing. Exits 1 when any link is not ok.",
    )
    p.add_argument("file", help="an artifact with a FILE.manifest.json beside it")
    p.add_argument("--json", action="store_true", help="print the tree as JSON")
    p.set_defaults(func=_lineage)
