# Training: results/{experiment}.ckpt from config/experiments/{experiment}-TRAIN.json.


rule train:
    input:
        experiment=experiment_file,
        train=tokens_file("train.bin"),
        val=tokens_file("val.bin"),
        tokenizer=tokens_file("tokenizer.json"),
    output:
        ckpt="results/{experiment}.ckpt",
        state="results/{experiment}.state.json",
        loss="results/{experiment}.loss.json",
        run_log="results/{experiment}.log",
    log:
        "results/logs/train/{experiment}.log",
    # A preempted job (SIGTERM: checkpoint, exit 75) fails, and its retry resumes.
    retries: config["train"]["retries"]
    threads: job_threads("train")
    resources:
        gpu=1,
    params:
        data=subpath(input.train, parent=True),
        engine=config["engine"],
        code=code_version("train"),
        run=run_dir,
        # gpu > 1 (e.g. --set-resources train:gpu=4) trains data parallel on the node's GPUs
        gpus=lambda wildcards, resources: (
            f"--gpus {resources.gpu}" if resources.gpu > 1 else ""
        ),
    shell:
        "andrea train --experiment {input.experiment} --data {params.data}"
        " --out {params.run}/{wildcards.experiment}.ckpt --resume --sigterm-exit-code 75"
        " --engine {params.engine} {params.gpus} > {log} 2>&1"
        " && for f in ckpt state.json loss.json log; do"
        " ln -f {params.run}/{wildcards.experiment}.$f results/{wildcards.experiment}.$f; done"
        " && if [ -e {params.run}/{wildcards.experiment}.best.ckpt ]; then"
        " ln -f {params.run}/{wildcards.experiment}.best.ckpt results/{wildcards.experiment}.best.ckpt; fi"


# The report's loss curve; too small a job to be worth a queue slot.
localrules:
    plot_loss,


rule plot_loss:
    input:
        loss=rules.train.output.loss,
    output:
        svg=report(
            "results/report/{experiment}.loss.svg",
            caption="../report/loss_curve.rst",
            category="Training",
            labels={"experiment": "{experiment}", "figure": "loss curve"},
        ),
    log:
        "results/logs/plot_loss/{experiment}.log",
    script:
        "../scripts/plot_loss.py"
