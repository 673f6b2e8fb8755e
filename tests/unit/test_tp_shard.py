"""Shard sizes equal DeepSpeed 0.19.8's ``get_shard_size_list`` (fixtures computed with it), both call forms;
shard specs cut and reassemble fused weights; unsplittable sizes name the layer and the numbers."""

from __future__ import annotations

import pytest
import torch

from zerospeed.module_inject.tp_shard import AutoTPMeta, get_shard_size, get_shard_size_list
from zerospeed.parallel.tensor import ShardSizeError, TPShardSpec, checked_shard_sizes, shard, split_heads, unshard

# (total, tp, name, AutoTPMeta kwargs, DeepSpeed 0.19.8 result): DS_ACCELERATOR=cpu, deepspeed.module_inject.tp_shard
DEEPSPEED = [
    (10, 4, None, {}, [3, 3, 2, 2]),
    (4096, 3, 'q_proj', {'num_kv_heads': 8}, [1536, 1536, 1024]),
    (100, 3, 'mlp.c_fc', {'tp_grain_size': 16}, [32, 32, 36]),
    (1024, 4, 'self_attn.k_proj', {'num_kv_heads': 2}, [512, 512, 0, 0]),
    (1536, 4, 'self_attn.q_proj', {'num_kv_heads': 6}, [512, 512, 256, 256]),
    (1536, 4, 'mlp.gate_proj', {'num_kv_heads': 6}, [384, 384, 384, 384]),
    (50257, 2, 'lm_head', {'num_kv_heads': 12}, [25129, 25128]),
    (50257, 4, 'lm_head', {'tp_grain_size': 64}, [12608, 12544, 12544, 12561]),
    (768, 4, 'attn.c_attn', {'num_kv_heads': 12}, [192, 192, 192, 192]),
    (30, 4, 'w1', {'num_kv_heads': 3}, [8, 8, 7, 7]),
    (30, 4, 'attn.o_proj', {'num_kv_heads': 3}, [10, 10, 10, 0]),
    (3, 4, None, {}, [1, 1, 1, 0]),
    (7, 2, 'x', {'tp_grain_size': 8}, [4, 3]),
    (130, 4, 'x', {'tp_grain_size': 32}, [32, 32, 32, 34]),
    (96, 4, 'q', {'num_kv_heads': 5}, [24, 24, 24, 24]),
    (12, 4, 'q', {'num_kv_heads': 12, 'tp_grain_size': 8}, [3, 3, 3, 3]),
]


@pytest.mark.parametrize("total,tp,name,kw,expected", DEEPSPEED)
def test_matches_deepspeed(total: int, tp: int, name: str | None, kw: dict, expected: list[int]) -> None:
    meta = AutoTPMeta(**kw)
    assert get_shard_size_list(total, tp, name, meta=meta) == expected
    assert get_shard_size_list(total, tp, meta, name) == expected          # DeepSpeed 0.19.8's argument order
    assert [get_shard_size(total, tp, name, r, meta=meta) for r in range(tp)] == expected
    assert [get_shard_size(total, tp, meta, name, r) for r in range(tp)] == expected


def test_meta_from_hf_style_config() -> None:
    class Cfg:
        num_attention_heads, num_key_value_heads, hidden_size = 8, 2, 64

    class Outer:
        text_config = Cfg()

    meta = AutoTPMeta.from_model_config(Outer(), tp_grain_size=4)
    assert meta == AutoTPMeta(num_kv_heads=2, num_attention_heads=8, n_embd=64, tp_grain_size=4)
    assert AutoTPMeta.from_model_config(None) == AutoTPMeta()


def test_rank_without_group_needs_matching_world() -> None:
    with pytest.raises(ValueError, match="group-local rank"):
        get_shard_size(10, 4)   # no process group here: world size 1 != 4


def test_unsplittable_names_layer_and_numbers() -> None:
    with pytest.raises(ShardSizeError, match=r"layer 'h.0.attn.k_proj': output features of 1024 .* size 4 .*"
                                             r"\[512, 512, 0, 0\].*num_kv_heads=2"):
        checked_shard_sizes(1024, 4, "h.0.attn.k_proj", "output features", AutoTPMeta(num_kv_heads=2))
    with pytest.raises(ShardSizeError, match="largest tensor-parallel size that gives every rank a share is 2"):
        checked_shard_sizes(1024, 4, "k_proj", "output features", AutoTPMeta(num_kv_heads=2))
    with pytest.raises(ShardSizeError, match="'lm': output features of 3 .* size 4.* share is 3"):
        checked_shard_sizes(3, 4, "lm", "output features")
    assert checked_shard_sizes(5, 2, "ok", "x") == (3, 2)


def test_split_heads() -> None:
    assert split_heads(12, 4, 2) == [(6, 2), (6, 2)]
    assert split_heads(12, 3, 2) == [(8, 2), (4, 1)]          # kv-head aware: q follows its kv group
    with pytest.raises(ShardSizeError, match="'blk.attn': 2 key/value heads .* size 4"):
        split_heads(8, 2, 4, "blk.attn")
    with pytest.raises(ShardSizeError, match="6 attention heads are not a multiple of 4"):
        split_heads(6, 4, 2)


def test_fused_spec_cuts_per_subparameter() -> None:
    # fused qkv of q=4 rows, k=v=2 rows over 2 ranks: rank 0 holds q[0:2], k[0:1], v[0:1]
    full = torch.arange(8 * 3).view(8, 3)
    spec = TPShardSpec((8, 3), 0, ((2, 2), (1, 1), (1, 1)))
    r0, r1 = shard(full, spec, 0), shard(full, spec, 1)
    assert r0[:, 0].tolist() == [0, 3, 12, 18] and r1[:, 0].tolist() == [6, 9, 15, 21]
    assert spec.ranges(1) == [(2, 4), (5, 6), (7, 8)] and spec.local_shape(1) == (4, 3)
    assert torch.equal(unshard([r0, r1], spec), full)
    uneven = TPShardSpec((5, 2), 0, ((3, 2),))
    x = torch.randn(5, 2)
    assert torch.equal(unshard([shard(x, uneven, 0), shard(x, uneven, 1)], uneven), x)
    assert shard(x, TPShardSpec((5, 2), None), 1) is x
