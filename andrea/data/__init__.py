"""Data stages: pull, prep, tokenizer, tokenize, manifests. Never imports an engine."""

HERMES3_DATASET = "NousResearch/Hermes-3-Dataset"
