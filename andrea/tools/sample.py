"""Text generation: ChatML prompts (through `andrea.data.chatml`), temperature / top-k sampling,
deterministic given a seed. `andrea sample` and the training loop's `.samples.json` share it.

Generation stops at `<|im_end|>` (the end of the assistant's turn) or `<|endoftext|>`.
"""

from __future__ import annotations

import json
from typing import Iterator

import numpy as np

from andrea.store.checkpoint import read_finite_weights
from andrea.data.chatml import IM_END, IM_START, ChatTokenizer
from andrea.common.errors import AndreaError
from andrea.tools.inference import inference_engine, load_tokenizer, tokenizer_for, vouched_state
from andrea.tools.inspect_ckpt import experiment_for
from andrea.spec.layout import ParameterLayout
from andrea.schedule.model import Model
from andrea.common.options import at_least, non_negative_float

TEMPERATURE = 0.8
TOP_K = 40
TRAINING_MAX_NEW_TOKENS = 48
ASSISTANT_OPENER = "assistant\n"


def check_vocab(tokenizer: ChatTokenizer, shape) -> None:
    if tokenizer.vocab_size > shape.vocab_size:
        raise AndreaError(
            f"the tokenizer has {tokenizer.vocab_size:,} tokens but the model's vocab_size is "
            f"{shape.vocab_size:,}; use the tokenizer the model was trained with"
        )


class Sampler:
    """A batch-1 inference model on the training model's engine and shape. With `share` (the training
    model), it reads that model's weights and runs inside its transient buffers between its steps: no
    memory of its own and no weights to load (ValueError where they do not fit)."""

    def __init__(self, engine, shape, tokenizer: ChatTokenizer, share: Model | None = None):
        check_vocab(tokenizer, shape)
        self.engine = engine
        self.shape = shape
        self.tokenizer = tokenizer
        self.model = Model(engine, shape, micro_batch=1, training=False, share=share)
        self.shares_weights = share is not None
        self.stop_ids = {tokenizer.im_end_id, tokenizer.endoftext_id}

    def load_params(self, params: np.ndarray) -> None:
        self.model.load_state(params)

    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, top_k: int,
                 rng: np.random.Generator) -> list[int]:
        """New token ids after the prompt, without the stop token; the context is the last seq_len ids."""
        return list(self.stream(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                rng=rng))

    def stream(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, top_k: int,
               rng: np.random.Generator) -> Iterator[int]:
        """`generate`, one token id at a time as each is picked; stopping early draws no more from rng."""
        T = self.shape.seq_len
        ids = list(prompt_ids)
        tokens = np.zeros((1, T), dtype=np.int32)
        for _ in range(max_new_tokens):
            context = ids[-T:]
            tokens[0, :len(context)] = context
            tokens[0, len(context):] = 0  # causal: positions after the context do not affect it
            self.model.forward(tokens, tokens)
            probs = self.engine.to_host(self.model.buf["probs"][0, len(context) - 1]).astype(np.float64)
            next_id = pick_token(probs, temperature, top_k, rng)
            if next_id in self.stop_ids:
                return
            ids.append(next_id)
            yield next_id


def pick_token(probs: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    """Temperature 0 is greedy; top_k 0 keeps every token."""
    if temperature <= 0:
        return int(np.argmax(probs))
    logits = np.log(np.maximum(probs, 1e-30)) / temperature
    if 0 < top_k < logits.size:
        cutoff = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits >= cutoff, logits, -np.inf)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return int(rng.choice(p.size, p=p))


def validation_prompts(tokenizer: ChatTokenizer, val_tokens: np.ndarray, count: int) -> list[list[int]]:
    """The first `count` conversations of the validation shard, cut after their first
    `<|im_start|>assistant\\n`: fixed prompts, so samples are comparable across steps."""
    opener = tokenizer.encode_text(ASSISTANT_OPENER)
    prompts: list[list[int]] = []
    start = 0
    toks = np.asarray(val_tokens)
    while len(prompts) < count and start < toks.size:
        ends = np.flatnonzero(toks[start:] == tokenizer.endoftext_id)
        stop = start + int(ends[0]) if ends.size else toks.size
        conv = toks[start:stop].tolist()
        for i, t in enumerate(conv):
            if t == tokenizer.im_start_id and conv[i + 1:i + 1 + len(opener)] == opener:
                prompts.append(conv[:i + 1 + len(opener)])
                break
        start = stop + 1
    return prompts


def training_samples(sampler: Sampler, prompts: list[list[int]], *, seed: int, step: int,
                     max_new_tokens: int = TRAINING_MAX_NEW_TOKENS) -> list[dict]:
    """Samples at one training step, seeded from (seed, step)."""
    rng = np.random.Generator(np.random.PCG64([seed, step]))
    tok = sampler.tokenizer
    return [
        {
            "prompt": tok.decode(p),
            "completion": tok.decode(sampler.generate(p, max_new_tokens=max_new_tokens, temperature=TEMPERATURE,
                                                      top_k=TOP_K, rng=rng)),
        }
        for p in prompts
    ]


def chat_turns(prompt: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def load_sampler(ckpt, *, experiment=None, tokenizer=None, engine: str = "auto") -> tuple[Sampler, object, int]:
    """A checkpoint's Sampler with its weights loaded, its experiment and its step; the experiment and tokenizer
    come from the state that vouches for it (or the explicit ones)."""
    vouched_state(ckpt)
    exp = experiment_for(ckpt, experiment)
    chat = load_tokenizer(tokenizer_for(ckpt, tokenizer))
    sampler = Sampler(inference_engine(engine, exp.precision), exp.model, chat)
    step, params = read_finite_weights(ckpt, ParameterLayout(exp.model), f"experiment {exp.name}")
    sampler.load_params(params)
    return sampler, exp, step


def one_line(text: str, limit: int) -> str:
    """Text on one line for a log: newlines shown as ⏎, cut to `limit` characters with … where cut."""
    flat = text.replace("\r\n", "\n").replace("\n", "⏎")
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def sample_line(step: int, item: dict) -> str:
    """One training sample as a log line: the prompt's last user message (else the whole prompt) -> the completion."""
    prompt = item["prompt"]
    opener = f"{IM_START}user\n"
    if opener in prompt:
        prompt = prompt.rsplit(opener, 1)[1].split(IM_END, 1)[0]
    return f"sample step {step}: {one_line(prompt, 60)} -> {one_line(item['completion'], 200)}"


def sample(ckpt, prompt: str, *, system: str | None = None, experiment=None, tokenizer=None, engine: str = "auto",
           temperature: float = TEMPERATURE, top_k: int = TOP_K, seed: int = 0, max_new_tokens: int = 256) -> dict:
    """One chat completion from a checkpoint; the same arguments give the same text."""
    if max_new_tokens < 1:
        raise AndreaError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    sampler, exp, step = load_sampler(ckpt, experiment=experiment, tokenizer=tokenizer, engine=engine)
    chat = sampler.tokenizer
    prompt_ids = chat.encode_prompt(chat_turns(prompt, system))
    if len(prompt_ids) >= exp.model.seq_len:
        raise AndreaError(
            f"--prompt is {len(prompt_ids)} tokens with its chat markup; the model sees at most "
            f"{exp.model.seq_len - 1} before it must generate; shorten it"
        )
    new = sampler.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           rng=np.random.Generator(np.random.PCG64(seed)))
    return {
        "checkpoint": str(ckpt), "step": step, "experiment": exp.name,
        "prompt": chat.decode(prompt_ids), "completion": chat.decode(new), "new_tokens": len(new),
        "stopped_by": "max_new_tokens" if len(new) == max_new_tokens else "end of turn",
        "temperature": temperature, "top_k": top_k, "seed": seed,
    }


def add_generation_options(p, *, seed_help: str, max_new_help: str) -> None:
    """The options `andrea sample` and `andrea chat` share: where the model comes from and how it samples."""
    p.add_argument("--experiment", help="experiment JSON (default: the one in the checkpoint's .state.json)")
    p.add_argument("--tokenizer", help="tokenizer.json (default: DATA/tokenizer.json of the training data)")
    p.add_argument("--temperature", type=non_negative_float, default=TEMPERATURE,
                   help=f"0 is greedy (default {TEMPERATURE})")
    p.add_argument("--top-k", type=at_least(0), default=TOP_K,
                   help=f"sample from the k likeliest tokens; 0: all (default {TOP_K})")
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--max-new-tokens", type=at_least(1), default=256, help=max_new_help)
    p.add_argument("--engine", default="auto", choices=("auto", "numpy", "cuda"),
                   help="auto (default) uses CUDA when a device is present, else NumPy")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sample",
        help="generate a chat reply from a checkpoint",
        description="Generate the assistant's reply to --prompt (ChatML, as in training) until <|im_end|> or "
        "--max-new-tokens. The experiment comes from the checkpoint's .state.json (or --experiment), the "
        "tokenizer from the data folder recorded there (or --tokenizer). Same seed, same text.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint, e.g. results/ANDREA-12M.ckpt or its .best.ckpt")
    p.add_argument("--prompt", required=True, help="the user's message")
    p.add_argument("--system", help="an optional system message before it")
    add_generation_options(p, seed_help="sampling seed (default 0)",
                           max_new_help="most tokens to generate (default 256)")
    p.add_argument("--json", action="store_true", help="print prompt, completion and settings as JSON")
    p.set_defaults(func=main)


def main(args) -> int:
    result = sample(args.ckpt, args.prompt, system=args.system, experiment=args.experiment, tokenizer=args.tokenizer,
                    engine=args.engine, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                    max_new_tokens=args.max_new_tokens)
    print(json.dumps(result, indent=2, ensure_ascii=False) if args.json else result["completion"])
    return 0
