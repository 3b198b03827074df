# Data stages: pull -> prep per source, one tokenizer over every source's train split, tokenize
# per source (and their union). Each artifact has a <file>.manifest.json, declared as an output so
# a rerun replaces it together with the artifact. Every folder is named by the hash of what
# defines it (common.smk, data identity): another config writes other folders. Each stage's
# progress goes to its log; its one-line summary (rows kept, dropped by reason) to the log and the
# terminal.

SOURCE_DIR = "results/data/sources/{source}-{pull}"
PREP_DIR = f"{SOURCE_DIR}/megachat-{{prep}}"
TOKENS_DIR = "results/data/tokens-V{vocab}-{data}"
# this config's prepared splits, in config order (the tokenizer's input order)
PREP_TRAIN = [f"{PREP_DIRS[name]}/train.parquet" for name in SOURCE_NAMES]
PREP_VAL = [f"{PREP_DIRS[name]}/val.parquet" for name in SOURCE_NAMES]
SPLIT_FILES = [
    f"{split}{kind}{manifest}"
    for split in ("train", "val")
    for kind in (".bin", ".mask.bin")
    for manifest in ("", ".manifest.json")
]


# Compute nodes may have no network; the Hub pull must run where snakemake runs.
localrules:
    pull_hermes3,


# A local source file is no input: its sha256 is in the folder's name, so an edit makes a new
# folder, and a touch that leaves the bytes alone reruns nothing.
rule pull_hermes3:
    input:
        unpack(check_source_dir),
    output:
        parquet=f"{SOURCE_DIR}/hermes3.parquet",
        manifest=f"{SOURCE_DIR}/hermes3.parquet.manifest.json",
    log:
        "results/logs/pull_hermes3/{source}-{pull}.log",
    params:
        source=pull_args,
        code=code_version("pull_hermes3"),
    shell:
        "andrea pull-hermes3 {params.source} --out {output.parquet} 2>> {log} | tee -a {log} >&2"


rule prep_megachat:
    input:
        unpack(check_source_dir),
        parquet=rules.pull_hermes3.output.parquet,
    output:
        train=f"{PREP_DIR}/train.parquet",
        val=f"{PREP_DIR}/val.parquet",
        train_manifest=f"{PREP_DIR}/train.parquet.manifest.json",
        val_manifest=f"{PREP_DIR}/val.parquet.manifest.json",
    log:
        "results/logs/prep_megachat/{source}-{pull}-{prep}.log",
    params:
        out_dir=subpath(output.train, parent=True),
        val_fraction=config["data"]["val_fraction"],
        code=code_version("prep_megachat"),
    shell:
        "andrea prep-megachat --in {input.parquet} --out-dir {params.out_dir}"
        " --val-fraction {params.val_fraction} 2>> {log} | tee -a {log} >&2"


# What the token folder's hash covers, written into it for people to read.
localrules:
    data_identity,


rule data_identity:
    input:
        unpack(check_tokens_dir),
    output:
        identity=f"{TOKENS_DIR}/identity.json",
    log:
        "results/logs/data_identity/V{vocab}-{data}.log",
    params:
        identity=identity_json,
    run:
        Path(output.identity).write_text(params.identity)
        Path(log[0]).write_text(f"wrote {output.identity}\n")


# One tokenizer for all sources, trained on the union of their train splits.
rule train_tokenizer:
    input:
        identity=rules.data_identity.output.identity,
        train=PREP_TRAIN,
    output:
        tokenizer=f"{TOKENS_DIR}/tokenizer.json",
        manifest=f"{TOKENS_DIR}/tokenizer.json.manifest.json",
    log:
        "results/logs/train_tokenizer/V{vocab}-{data}.log",
    threads: job_threads("train_tokenizer")
    params:
        inputs=lambda wildcards, input: " ".join(f"--in {p}" for p in input.train),
        min_frequency=config["tokenizer"]["min_frequency"],
        max_token_length=config["tokenizer"]["max_token_length"],
        unspaced_chunk=config["tokenizer"]["unspaced_chunk"],
        code=code_version("train_tokenizer"),
    shell:
        "andrea train-tokenizer {params.inputs} --vocab-size {wildcards.vocab}"
        " --min-frequency {params.min_frequency} --max-token-length {params.max_token_length}"
        " --unspaced-chunk {params.unspaced_chunk} --threads {threads}"
        " --out {output.tokenizer} 2>> {log} | tee -a {log} >&2"


# Each source's shards and loss masks go to TOKENS_DIR/<source>/, their union to TOKENS_DIR, next
# to the tokenizer: training reads the sources and the tokenizer from that one folder.
rule tokenize:
    input:
        unpack(check_tokens_dir),
        tokenizer=rules.train_tokenizer.output.tokenizer,
        train=PREP_TRAIN,
        val=PREP_VAL,
    output:
        [f"{TOKENS_DIR}/{name}" for name in SPLIT_FILES],
        expand(
            f"{TOKENS_DIR}/{{source}}/{{name}}",
            source=SOURCE_NAMES,
            name=SPLIT_FILES,
            allow_missing=True,
        ),
    log:
        "results/logs/tokenize/V{vocab}-{data}.log",
    threads: job_threads("tokenize")
    params:
        sources=tokenize_sources,
        out_dir=subpath(input.tokenizer, parent=True),
        code=code_version("tokenize"),
    shell:
        "andrea tokenize --tokenizer {input.tokenizer} {params.sources}"
        " --out-dir {params.out_dir} --threads {threads} 2>> {log} | tee -a {log} >&2"
