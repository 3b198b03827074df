"""What running a checkpoint needs besides its weights, for `andrea eval`, `andrea sample`, the
training loop's samples and the Hugging Face export: the engine to run it on, and its tokenizer."""

from __future__ import annotations

from pathlib import Path

from andrea.store.checkpoint import read_header, read_state, state_path, verify_against_state
from andrea.data.chatml import ChatTokenizer
from andrea.engines import engine_name, make_engine
from andrea.common.errors import AndreaError
from andrea.store.identity import check_tokenizer


def inference_engine(name: str, precision: str):
    """The engine that runs a checkpoint: CUDA at the experiment's precision, or the NumPy engine
    (fp32, the only precision it has) when there is no device."""
    return make_engine(name, precision=precision if engine_name(name) == "cuda" else "fp32")


def load_tokenizer(path) -> ChatTokenizer:
    return ChatTokenizer.load(path)


def find_tokenizer(data_dir, explicit=None) -> Path | None:
    """--tokenizer when given, else DATA/tokenizer.json when it exists (the data stages keep it beside the shards)."""
    # inside: the tokenize stage imports pyarrow, which `andrea --help` should not wait for
    from andrea.data.tokenize_shards import TOKENIZER_NAME

    if explicit:
        return Path(explicit)
    candidate = Path(data_dir) / TOKENIZER_NAME
    return candidate if candidate.is_file() else None


def tokenizer_for(ckpt, explicit=None) -> Path:
    """The tokenizer of a checkpoint: --tokenizer, else the one beside the data it was trained on; either way
    the one its run's state records (identity.check_tokenizer)."""
    state = read_state(ckpt) or {}
    data_dir = state.get("data", {}).get("dir")
    path = find_tokenizer(data_dir, explicit) if (explicit or data_dir) else None
    if path is None:
        where = f"in {data_dir}, the data folder its .state.json records" if data_dir else "recorded for it"
        raise AndreaError(f"{ckpt}: no tokenizer.json {where}; pass --tokenizer")
    if not path.is_file():
        raise AndreaError(f"{path}: tokenizer file not found; pass --tokenizer with the one {ckpt} was trained with")
    check_tokenizer(ckpt, state, path, state_path(ckpt))
    return path


def vouched_state(ckpt) -> dict | None:
    """The state that speaks for a checkpoint to be run (its experiment, tokenizer and data come from it), after
    checking that it vouches for this very file: sha256 among its recent checkpoints, or its best."""
    read_header(ckpt)  # a checkpoint at all, before its state is read
    verify_against_state(ckpt)
    return read_state(ckpt)
