"""The attention kernels' launch order (andrea/ops/attn.py heads_per_group; kernels/attn_bf16.cu block_at): every
head in one group, longest tile first across all, while every head's K and V fit in L2; groups of ATTN_L2_GROUP
heads past that. That the order moves no bit is tests/test_cuda_engine.py's (GPU)."""

import pytest

from andrea.config import load_experiment
from andrea.ops.attn import ATTN_BF16_HEAD, ATTN_L2_GROUP, heads_per_group
from conftest import EXPERIMENTS

L2 = {"H100": 50 * 2**20, "H200": 60 * 2**20}


@pytest.mark.parametrize("card", sorted(L2))
@pytest.mark.parametrize("name, batch", [("ANDREA-12M-TRAIN", 32), ("ANDREA-120M-TRAIN", 8)])  # the benchmark's
def test_the_experiments_keep_one_group_of_every_head(card, name, batch):
    model = load_experiment(EXPERIMENTS / f"{name}.json").model
    heads = batch * model.n_head
    assert model.d_model // model.n_head == ATTN_BF16_HEAD
    assert heads_per_group(heads, model.seq_len, L2[card]) == heads


@pytest.mark.parametrize("card", sorted(L2))
def test_heads_whose_k_and_v_pass_l2_run_in_small_groups(card):
    T = 1024
    kv = 2 * T * ATTN_BF16_HEAD * 2
    fit = L2[card] // kv
    assert heads_per_group(fit, T, L2[card]) == fit
    assert heads_per_group(fit + 1, T, L2[card]) == ATTN_L2_GROUP
    assert heads_per_group(16 * 32, T, L2[card]) == ATTN_L2_GROUP  # FlashAttention-3's benchmark at T 1024


def test_a_group_never_holds_more_heads_than_there_are():
    assert heads_per_group(3, 1 << 20, 2**20) == 3
