include: "workflow/Snakefile"
