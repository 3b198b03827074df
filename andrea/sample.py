"""Text generation from a model: ChatML prompts, temperature / top-k, deterministic given a seed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from andrea.model import Model

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ASSISTANT_OPENER = "assistant\n"


def load_tokenizer(path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


class Sampler:
    """A batch-1 inference model sharing the training model's engine and shape."""

    def __init__(self, engine, shape, tokenizer):
        self.engine = engine
        self.shape = shape
        self.tokenizer = tokenizer
        self.model = Model(engine, shape, micro_batch=1, training=False)
        self.stop_ids = {tokenizer.token_to_id(t) for t in (IM_END, END_OF_TEXT)} - {None}

    def load_params(self, params: np.ndarray) -> None:
        self.model.load_state(params)

    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, top_k: int,
                 rng: np.random.Generator) -> list[int]:
        T = self.shape.seq_len
        ids = list(prompt_ids)
        out: list[int] = []
        tokens = np.zeros((1, T), dtype=np.int32)
        for _ in range(max_new_tokens):
            context = ids[-T:]
            tokens[0, :len(context)] = context
            tokens[0, len(context):] = 0
            self.model.forward(tokens, tokens)
            probs = self.engine.to_host(self.model.buf["probs"][0, len(context) - 1]).astype(np.float64)
            next_id = pick_token(probs, temperature, top_k, rng)
            if next_id in self.stop_ids:
                break
            ids.append(next_id)
            out.append(next_id)
        return out


def pick_token(probs: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(probs))
    logits = np.log(np.maximum(probs, 1e-30)) / temperature
    if 0 < top_k < logits.size:
        cutoff = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits >= cutoff, logits, -np.inf)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return int(rng.choice(p.size, p=p))


def validation_prompts(tokenizer, val_tokens: np.ndarray, count: int) -> list[list[int]]:
    """The first `count` conversations of the validation shard, cut after their first
    `<|im_start|>assistant\\n`: fixed prompts, so samples are comparable across steps."""
    eot = tokenizer.token_to_id(END_OF_TEXT)
    im_start = tokenizer.token_to_id(IM_START)
    opener = tokenizer.encode(ASSISTANT_OPENER, add_special_tokens=False).ids
    prompts: list[list[int]] = []
    start = 0
    toks = np.asarray(val_tokens)
    while len(prompts) < count and start < toks.size:
        ends = np.flatnonzero(toks[start:] == eot)
        stop = start + int(ends[0]) if ends.size else toks.size
        conv = toks[start:stop].tolist()
        for i, t in enumerate(conv):
            if t == im_start and conv[i + 1:i + 1 + len(opener)] == opener:
                prompts.append(conv[:i + 1 + len(opener)])
                break
        start = stop + 1
    return prompts


def training_samples(sampler: Sampler, prompts: list[list[int]], *, seed: int, step: int,
                     max_new_tokens: int = 48) -> list[dict]:
    """Samples at one training step, seeded from (seed, step)."""
    rng = np.random.Generator(np.random.PCG64([seed, step]))
    tok = sampler.tokenizer
    return [
        {
            "prompt": tok.decode(p, skip_special_tokens=False),
            "completion": tok.decode(sampler.generate(p, max_new_tokens=max_new_tokens, temperature=0.8,
                                                      top_k=40, rng=rng)),
        }
        for p in prompts
    ]


def find_tokenizer(data_dir, explicit=None) -> Path | None:
    if explicit:
        return Path(explicit)
    candidate = Path(data_dir) / "tokenizer.json"
    return candidate if candidate.is_file() else None
