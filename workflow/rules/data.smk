# Data stages: pull -> prep -> tokenizer -> tokenize. Each artifact has a <file>.manifest.json,
# declared as an output so a rerun replaces it together with the artifact.


# Compute nodes may have no network; the Hub pull must run where snakemake runs.
localrules:
    pull_hermes3,


rule pull_hermes3:
    input:
        unpack(pull_inputs),
    output:
        parquet="results/data/hermes3.parquet",
        manifest="results/data/hermes3.parquet.manifest.json",
    log:
        "results/logs/pull_hermes3.log",
    params:
        source=pull_args(),
        code=code_version("pull_hermes3"),
    shell:
        "andrea pull-hermes3 {params.source} --out {output.parquet} > {log} 2>&1"


rule prep_megachat:
    input:
        parquet=rules.pull_hermes3.output.parquet,
    output:
        train="results/data/megachat/train.parquet",
        val="results/data/megachat/val.parquet",
        train_manifest="results/data/megachat/train.parquet.manifest.json",
        val_manifest="results/data/megachat/val.parquet.manifest.json",
    log:
        "results/logs/prep_megachat.log",
    params:
        out_dir=subpath(output.train, parent=True),
        val_fraction=config["data"]["val_fraction"],
        code=code_version("prep_megachat"),
    shell:
        "andrea prep-megachat --in {input.parquet} --out-dir {params.out_dir}"
        " --val-fraction {params.val_fraction} > {log} 2>&1"


rule train_tokenizer:
    input:
        train=rules.prep_megachat.output.train,
    output:
        tokenizer="results/data/tokens-V{vocab}/tokenizer.json",
        manifest="results/data/tokens-V{vocab}/tokenizer.json.manifest.json",
    log:
        "results/logs/train_tokenizer/V{vocab}.log",
    threads: job_threads("train_tokenizer")
    params:
        min_frequency=config["tokenizer"]["min_frequency"],
        max_token_length=config["tokenizer"]["max_token_length"],
        unspaced_chunk=config["tokenizer"]["unspaced_chunk"],
        code=code_version("train_tokenizer"),
    shell:
        "andrea train-tokenizer --in {input.train} --vocab-size {wildcards.vocab}"
        " --min-frequency {params.min_frequency} --max-token-length {params.max_token_length}"
        " --unspaced-chunk {params.unspaced_chunk} --threads {threads}"
        " --out {output.tokenizer} > {log} 2>&1"


# The shards go next to their tokenizer: training reads all three from one folder.
rule tokenize:
    input:
        tokenizer=rules.train_tokenizer.output.tokenizer,
        train=rules.prep_megachat.output.train,
        val=rules.prep_megachat.output.val,
    output:
        train="results/data/tokens-V{vocab}/train.bin",
        val="results/data/tokens-V{vocab}/val.bin",
        train_manifest="results/data/tokens-V{vocab}/train.bin.manifest.json",
        val_manifest="results/data/tokens-V{vocab}/val.bin.manifest.json",
        train_mask="results/data/tokens-V{vocab}/train.mask.bin",
        val_mask="results/data/tokens-V{vocab}/val.mask.bin",
        train_mask_manifest="results/data/tokens-V{vocab}/train.mask.bin.manifest.json",
        val_mask_manifest="results/data/tokens-V{vocab}/val.mask.bin.manifest.json",
    log:
        "results/logs/tokenize/V{vocab}.log",
    threads: job_threads("tokenize")
    params:
        in_dir=subpath(input.train, parent=True),
        out_dir=subpath(output.train, parent=True),
        code=code_version("tokenize"),
    shell:
        "andrea tokenize --tokenizer {input.tokenizer} --in-dir {params.in_dir}"
        " --out-dir {params.out_dir} --threads {threads} > {log} 2>&1"
