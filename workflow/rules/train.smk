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
    # A job whose trainer alone is sent SIGTERM (it checkpoints and exits 75) resumes in the same
    # job, below; one that SLURM preempts or times out fails, and its retry resumes.
    retries: config["train"]["retries"]
    threads: job_threads("train")
    resources:
        gpu=1,
    params:
        data=subpath(input.train, parent=True),
        engine=config["engine"],
        code=code_version("train"),
        run=run_dir,
        overrides=set_flags,
        cpu_max_steps=config["train"]["cpu_max_steps"],
        device=planned_device,
        # gpu > 1 (e.g. --set-resources train:gpu=4) trains data parallel on the node's GPUs
        gpus=lambda wildcards, resources: (
            f"--gpus {resources.gpu}" if resources.gpu > 1 else ""
        ),
    # The trainer's stderr (log lines, memory plan) goes to the log; its stdout, the progress
    # lines, to the log and the terminal. A preemption prints one line and resumes, as long as each
    # one comes at a later step than the last (`last`); the log is appended to, never truncated.
    # Then the run's files are linked into results/ (a run extended later writes new files by
    # rename, so these links keep their bytes; the optional ones of another run are removed) and
    # touched: a reused run's files may be older than the experiment file.
    shell:
        "last=-1; while :; do"
        " andrea train --experiment {input.experiment} --data {params.data} {params.overrides}"
        " --out {params.run}/{wildcards.experiment}.ckpt --resume --sigterm-exit-code 75"
        " --cpu-max-steps {params.cpu_max_steps} --engine {params.engine} {params.gpus}"
        " 2>> {log} | tee -a {log} >&2 && break || rc=$?;"
        " step=$(sed -n 's/^SIGTERM.* stopped at step \\([0-9]*\\).*/\\1/p' {log} | tail -n 1);"
        " if [ $rc -ne 75 ] || [ ${{step:-0}} -le $last ]; then exit $rc; fi;"
        " echo '{wildcards.experiment}: preempted at step '$step'; resuming' | tee -a {log} >&2;"
        " last=$step; done"
        " && sed -n 's/^done: /{wildcards.experiment}: done: /p' {log} | tail -n 1 >&2"
        " && for f in ckpt state.json loss.json log; do"
        " ln -f {params.run}/{wildcards.experiment}.$f results/{wildcards.experiment}.$f; done"
        " && for f in best.ckpt samples.json; do"
        " if [ -e {params.run}/{wildcards.experiment}.$f ]; then"
        " ln -f {params.run}/{wildcards.experiment}.$f results/{wildcards.experiment}.$f;"
        " else rm -f results/{wildcards.experiment}.$f; fi; done"
        " && touch {output}"


# The report's loss curve; too small a job to be worth a queue slot.
localrules:
    plot_loss,


rule plot_loss:
    input:
        loss=rules.train.output.loss,
        state=rules.train.output.state,
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
