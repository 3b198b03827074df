include: "workflow/Snakefile"


# Snakemake forgets a default target chosen inside an included file (snakemake/snakemake#2773).
workflow.default_target = "all"
