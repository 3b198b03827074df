"""Data stages: pull, prep, tokenizer, tokenize, manifests. Never imports an engine."""
