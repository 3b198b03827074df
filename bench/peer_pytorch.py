"""The PyTorch peer of the benchmark: ANDREA's model in plain PyTorch, its training step timed on one device.

The same architecture as andrea/spec/layout.py (pre-LN GPT, no biases but LayerNorm's, tanh-GELU MLP of 4x, learned
positions, the classifier tied to the token embedding; the same parameter count, tests/test_peer_pytorch.py), trained
with AdamW and global-norm clipping at 1.0 on random tokens. The model's shape is the experiment's
(config/experiments/ANDREA-<NAME>-TRAIN.json); the micro-batch is the benchmark's (scripts/bench.py BENCH).

    python3 bench/peer_pytorch.py SHAPE VARIANT [STEPS] [--device cuda|cpu]
      SHAPE    12m | 120m | 350m | tiny
      VARIANT  fp32 | tf32 | bf16 | bf16-compile | fp8-compile (torchao float8 training, tensorwise scaling, on every
               nn.Linear; the tied classifier stays bf16; needs the torchao package)

Prints one JSON line: ms per step and tokens/s (the median of the timed steps), peak device memory, the last loss.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPERIMENTS = Path(__file__).resolve().parents[1] / "config" / "experiments"
# SHAPE: (experiment, micro-batch of the benchmark)
SHAPES = {"12m": ("ANDREA-12M", 32), "120m": ("ANDREA-120M", 8), "350m": ("ANDREA-350M", 8), "tiny": ("ANDREA-tiny", 4)}
VARIANTS = ("fp32", "tf32", "bf16", "bf16-compile", "fp8-compile")
WARMUP_STEPS = 10


def model_shape(shape: str) -> dict:
    """n_layer, d_model, n_head, vocab_size, seq_len of the experiment behind SHAPE."""
    name, _ = SHAPES[shape]
    return json.loads((EXPERIMENTS / f"{name}-TRAIN.json").read_text())["model"]


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.attn_out = nn.Linear(d_model, d_model, bias=False)
        self.mlp_up = nn.Linear(d_model, 4 * d_model, bias=False)
        self.mlp_down = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        heads = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                 for t in self.qkv(self.ln1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_down(F.gelu(self.mlp_up(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, n_layer: int, d_model: int, n_head: int, vocab_size: int, seq_len: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, d_model), nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        for module in self.modules():  # N(0, 0.02) as andrea.schedule.model.init_params (without its residual scaling)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # the tied classifier
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def run(shape: str, variant: str, steps: int, device: str) -> dict:
    dims, (_, B) = model_shape(shape), SHAPES[shape]
    torch.manual_seed(0)
    tf32 = variant != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    model = GPT(**dims).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device == "cuda")
    if variant.startswith("fp8"):
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)
    forward = torch.compile(model) if variant.endswith("compile") else model
    low = variant.startswith(("bf16", "fp8"))
    batches = torch.randint(0, dims["vocab_size"], (8, B, dims["seq_len"] + 1), device=device)

    def step(i: int) -> torch.Tensor:
        rows = batches[i % len(batches)]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=low):
            loss = forward(rows[:, :-1], rows[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i in range(WARMUP_STEPS if device == "cuda" else 1):
        step(i)
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps):
        start = time.perf_counter()
        loss = step(i)
        sync()
        times.append(time.perf_counter() - start)
    ms = sorted(times)[len(times) // 2] * 1e3
    return {"peer": "pytorch", "shape": shape, "variant": variant, "device": device,
            "params": sum(p.numel() for p in model.parameters()), "ms_per_step": round(ms, 3),
            "tokens_per_s": round(B * dims["seq_len"] / ms * 1e3),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if device == "cuda" else None,
            "loss": round(loss.item(), 4), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("steps", nargs="?", type=int, default=30, help="timed steps (default 30)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"steps {args.steps}: time at least one step")
    print(json.dumps(run(args.shape, args.variant, args.steps, args.device)), flush=True)


if __name__ == "__main__":
    main()
