"""`andrea export-hf`: a checkpoint as a Hugging Face GPT-2 folder.

ANDREA is GPT-2 without biases, so the export is a renaming: GPT-2's Conv1D stores weights
`[in, out]` as we do, `c_attn` is Q|K|V concatenated along `out`, biases are zeros, `lm_head` is
tied to `wte`. Weights go to `model.safetensors` (no pickle); the tokenizer is copied with a
tokenizer_config.json carrying the ChatML chat template.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from andrea.data.chatml import ENDOFTEXT, IM_END, IM_START
from andrea.common.errors import AndreaError

STAGE = "export-hf"

# ChatML as andrea.data.chatml.render writes it, plus the open assistant turn of encode_prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    f"{{{{ '{IM_START}' + message['role'] + '\\n' + message['content'] + '{IM_END}' + '\\n' }}}}"
    "{% endfor %}"
    f"{{% if add_generation_prompt %}}{{{{ '{IM_START}assistant\\n' }}}}{{% endif %}}"
)


def gpt2_tensors(layout, params: np.ndarray) -> dict[str, np.ndarray]:
    """GPT2LMHeadModel's state dict (without the tied lm_head) from a flat parameter vector."""
    C = layout.shape.d_model
    out = {"transformer.wte.weight": layout.view(params, "wte"), "transformer.wpe.weight": layout.view(params, "wpe")}
    for l in range(layout.shape.n_layer):
        p = layout.layer(params, l)
        h = f"transformer.h.{l}."
        out.update({
            h + "ln_1.weight": p["LN1.gamma"], h + "ln_1.bias": p["LN1.beta"],
            h + "attn.c_attn.weight": np.concatenate([p["W_Q"], p["W_K"], p["W_V"]], axis=1),
            h + "attn.c_attn.bias": np.zeros(3 * C, np.float32),
            h + "attn.c_proj.weight": p["W_O"], h + "attn.c_proj.bias": np.zeros(C, np.float32),
            h + "ln_2.weight": p["LN2.gamma"], h + "ln_2.bias": p["LN2.beta"],
            h + "mlp.c_fc.weight": p["W_1"], h + "mlp.c_fc.bias": np.zeros(4 * C, np.float32),
            h + "mlp.c_proj.weight": p["W_2"], h + "mlp.c_proj.bias": np.zeros(C, np.float32),
        })
    out["transformer.ln_f.weight"] = layout.view(params, "LNf.gamma")
    out["transformer.ln_f.bias"] = layout.view(params, "LNf.beta")
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def gpt2_config(shape, chat) -> dict:
    from andrea.ops.layernorm import LN_EPS

    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": shape.vocab_size,
        "n_positions": shape.seq_len,
        "n_embd": shape.d_model,
        "n_layer": shape.n_layer,
        "n_head": shape.n_head,
        "n_inner": 4 * shape.d_model,
        "activation_function": "gelu_new",  # the tanh approximation
        "layer_norm_epsilon": LN_EPS,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True,  # 1/sqrt(head_dim), as ours
        "tie_word_embeddings": True,
        "bos_token_id": chat.endoftext_id,
        "eos_token_id": chat.im_end_id,
        "pad_token_id": chat.endoftext_id,
        "dtype": "float32",
    }


def tokenizer_config(shape) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,  # a reply ends with its turn
        "pad_token": ENDOFTEXT,
        "model_max_length": shape.seq_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def generation_config(chat) -> dict:
    return {"bos_token_id": chat.endoftext_id, "eos_token_id": [chat.im_end_id, chat.endoftext_id],
            "pad_token_id": chat.endoftext_id}


def export_hf(ckpt, out_dir, *, experiment=None, tokenizer=None) -> list[Path]:
    """Write the folder; returns the files written."""
    from andrea.common.atomic import atomic_path, atomic_write, write_json_atomic
    from andrea.store.checkpoint import read_finite_weights
    from andrea.tools.inspect_ckpt import experiment_for
    from andrea.spec.layout import ParameterLayout
    from andrea.store.manifest import write_manifest
    from andrea.tools.inference import load_tokenizer, tokenizer_for, vouched_state
    from andrea.tools.sample import check_vocab

    try:
        from safetensors.numpy import save
    except ImportError:
        raise AndreaError("export-hf needs the safetensors package; install it with `pip install safetensors`") from None
    start = time.perf_counter()
    ckpt, out_dir = Path(ckpt), Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise AndreaError(f"{out_dir}: exists and is not a folder; choose another OUTDIR")
    vouched_state(ckpt)
    exp = experiment_for(ckpt, experiment)
    shape, layout = exp.model, ParameterLayout(exp.model)
    tokenizer_path = tokenizer_for(ckpt, tokenizer)
    chat = load_tokenizer(tokenizer_path)
    check_vocab(chat, shape)
    step, params = read_finite_weights(ckpt, layout, f"experiment {exp.name}")

    out_dir.mkdir(parents=True, exist_ok=True)
    weights = out_dir / "model.safetensors"
    with atomic_write(weights) as f:  # bytes through Python's open, so the file gets the usual permissions
        f.write(save(gpt2_tensors(layout, params),
                     metadata={"format": "pt", "andrea_experiment": exp.name, "andrea_step": str(step)}))
    with atomic_path(out_dir / "tokenizer.json") as tmp:
        shutil.copyfile(tokenizer_path, tmp)
    configs = {"config.json": gpt2_config(shape, chat), "generation_config.json": generation_config(chat),
               "tokenizer_config.json": tokenizer_config(shape)}
    for name, config in configs.items():
        write_json_atomic(out_dir / name, config)
    write_manifest(
        weights, stage=STAGE, inputs=[ckpt, tokenizer_path],
        config={"experiment": exp.raw, "format": "transformers GPT2LMHeadModel, safetensors float32"},
        counts={"step": step, "n_params": layout.n_params}, wall_time_s=time.perf_counter() - start,
    )
    return [weights, out_dir / "tokenizer.json", *(out_dir / name for name in configs)]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export-hf",
        help="export a checkpoint as a Hugging Face transformers GPT-2 folder",
        description="Write OUTDIR with config.json, model.safetensors, generation_config.json, tokenizer.json "
        "and tokenizer_config.json (with the ChatML chat template), loadable with "
        "transformers.GPT2LMHeadModel.from_pretrained and AutoTokenizer.from_pretrained. No pickle.",
    )
    p.add_argument("ckpt", help="checkpoint, e.g. results/ANDREA-12M.ckpt")
    p.add_argument("out_dir", metavar="OUTDIR", help="folder to write (created; files in it are replaced)")
    p.add_argument("--experiment", help="experiment JSON (default: the one in the checkpoint's .state.json)")
    p.add_argument("--tokenizer", help="tokenizer.json (default: DATA/tokenizer.json of the training data)")
    p.set_defaults(func=main)


def main(args) -> int:
    files = export_hf(args.ckpt, args.out_dir, experiment=args.experiment, tokenizer=args.tokenizer)
    print(f"wrote {args.out_dir}: {', '.join(f.name for f in files)}")
    return 0
