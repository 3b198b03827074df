# Evaluation: val loss, perplexity and bits per byte of each checkpoint, and their table.


# The experiment is the checkpoint's own (its .state.json's: the JSON with the config's overrides).
rule eval:
    input:
        ckpt=rules.train.output.ckpt,
        state=rules.train.output.state,
        val=tokens_file("val.bin"),
        tokenizer=tokens_file("tokenizer.json"),
    output:
        metrics=report(
            "results/eval/{experiment}.json",
            caption="../report/eval_json.rst",
            category="Evaluation",
            labels={"experiment": "{experiment}", "file": "metrics (JSON)"},
        ),
        manifest="results/eval/{experiment}.json.manifest.json",
    log:
        "results/logs/eval/{experiment}.log",
    threads: job_threads("eval")
    resources:
        gpu=1,
    params:
        data=subpath(input.val, parent=True),
        engine=config["engine"],
        code=code_version("eval"),
    shell:
        "andrea eval --ckpt {input.ckpt} --data {params.data}"
        " --engine {params.engine} --out {output.metrics} > {log} 2>&1"


# Reformats a few small JSON files; not worth a queue slot.
localrules:
    eval_table,


rule eval_table:
    input:
        metrics=expand(rules.eval.output.metrics, experiment=config["experiments"]),
        # whether each checkpoint finished its program (train.cpu_max_steps stops it early)
        states=expand(rules.train.output.state, experiment=config["experiments"]),
    output:
        html=report(
            "results/report/evaluation.html",
            caption="../report/eval_table.rst",
            category="Evaluation",
            labels={"experiment": "all", "file": "table"},
        ),
    log:
        "results/logs/eval_table.log",
    script:
        "../scripts/eval_table.py"
