# Data stages: pull -> prep per source, one tokenizer over every source's train split, tokenize
# per source (and their union). Each artifact has a <file>.manifest.json, declared as an output so
# a rerun replaces it together with the artifact.

SOURCE_DIR = "results/data/sources/{source}"
TOKENS_DIR = "results/data/tokens-V{vocab}"
SPLIT_FILES = [
    f"{split}{kind}{manifest}"
    for split in ("train", "val")
    for kind in (".bin", ".mask.bin")
    for manifest in ("", ".manifest.json")
]


# Compute nodes may have no network; the Hub pull must run where snakemake runs.
localrules:
    pull_hermes3,


rule pull_hermes3:
    input:
        unpack(pull_inputs),
    output:
        parquet=f"{SOURCE_DIR}/hermes3.parquet",
        manifest=f"{SOURCE_DIR}/hermes3.parquet.manifest.json",
    log:
        "results/logs/pull_hermes3/{source}.log",
    params:
        source=pull_args,
        code=code_version("pull_hermes3"),
    shell:
        "andrea pull-hermes3 {params.source} --out {output.parquet} > {log} 2>&1"


rule prep_megachat:
    input:
        parquet=rules.pull_hermes3.output.parquet,
    output:
        train=f"{SOURCE_DIR}/megachat/train.parquet",
        val=f"{SOURCE_DIR}/megachat/val.parquet",
        train_manifest=f"{SOURCE_DIR}/megachat/train.parquet.manifest.json",
        val_manifest=f"{SOURCE_DIR}/megachat/val.parquet.manifest.json",
    log:
        "results/logs/prep_megachat/{source}.log",
    params:
        out_dir=subpath(output.train, parent=True),
        val_fraction=config["data"]["val_fraction"],
        code=code_version("prep_megachat"),
    shell:
        "andrea prep-megachat --in {input.parquet} --out-dir {params.out_dir}"
        " --val-fraction {params.val_fraction} > {log} 2>&1"


# One tokenizer for all sources, trained on the union of their train splits.
rule train_tokenizer:
    input:
        train=expand(rules.prep_megachat.output.train, source=SOURCE_NAMES),
    output:
        tokenizer=f"{TOKENS_DIR}/tokenizer.json",
        manifest=f"{TOKENS_DIR}/tokenizer.json.manifest.json",
    log:
        "results/logs/train_tokenizer/V{vocab}.log",
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
        " --out {output.tokenizer} > {log} 2>&1"


# Each source's shards and loss masks go to TOKENS_DIR/<source>/, their union to TOKENS_DIR, next
# to the tokenizer: training reads the sources and the tokenizer from that one folder.
rule tokenize:
    input:
        tokenizer=rules.train_tokenizer.output.tokenizer,
        train=expand(rules.prep_megachat.output.train, source=SOURCE_NAMES),
        val=expand(rules.prep_megachat.output.val, source=SOURCE_NAMES),
    output:
        [f"{TOKENS_DIR}/{name}" for name in SPLIT_FILES],
        expand(
            "results/data/tokens-V{{vocab}}/{source}/{name}",
            source=SOURCE_NAMES,
            name=SPLIT_FILES,
        ),
    log:
        "results/logs/tokenize/V{vocab}.log",
    threads: job_threads("tokenize")
    params:
        sources=tokenize_sources,
        out_dir=subpath(input.tokenizer, parent=True),
        code=code_version("tokenize"),
    shell:
        "andrea tokenize --tokenizer {input.tokenizer} {params.sources}"
        " --out-dir {params.out_dir} --threads {threads} > {log} 2>&1"
