"""Fused QKV (GQA, uneven head groups) and packed weights split per sub-matrix on real Gloo ranks, gathered
outputs in [q | k | v] order; sizes that cannot be split fail on every rank with the layer and the numbers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zerospeed import comm
from zerospeed.module_inject.layers import (FusedQKVLinear, LinearAllreduce, LinearLayer, SubParamLinearAllreduce,
                                            SubParamLinearLayer, VocabParallelEmbedding)
from zerospeed.parallel.tensor import ShardSizeError, TPShardSpec, shard
from zerospeed.testing import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)


def _check_column(layer: nn.Module, full: nn.Linear, rank: int, x: torch.Tensor) -> None:
    probe = torch.randn(x.shape[0], full.out_features, generator=torch.Generator().manual_seed(9))
    (full(x) * probe).sum().backward()
    y = layer(x)
    torch.testing.assert_close(y, full(x), **TOL)         # gather_output=True: back in [q | k | v] order
    (y * probe).sum().backward()
    spec = layer.shard_specs()
    torch.testing.assert_close(layer.weight.grad, shard(full.weight.grad, spec["weight"], rank), **TOL)
    torch.testing.assert_close(layer.bias.grad, shard(full.bias.grad, spec["bias"], rank), **TOL)
    full_params = layer.gathered_parameters()
    torch.testing.assert_close(full_params["weight"], full.weight.detach(), rtol=0, atol=0)


def _fused(kv: int, heads: int) -> list[int]:
    group, rank, tp = comm.world_group(), comm.get_rank(), comm.get_world_size()
    hd = 2
    torch.manual_seed(0)
    full = nn.Linear(8, (heads + 2 * kv) * hd)
    qkv = FusedQKVLinear(copy.deepcopy(full), group, heads, kv, name="attn.qkv", gather_output=True)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    _check_column(qkv, full, rank, x)
    # per rank (q heads, kv heads): kv-head aware, uneven when kv % tp != 0
    q_heads, kv_heads = qkv.local_heads
    assert q_heads == kv_heads * (heads // kv)
    torch.manual_seed(0)
    full.zero_grad()
    sub = SubParamLinearLayer(copy.deepcopy(full), group, shape=((heads * hd, kv * hd, kv * hd), -1), name="c_attn",
                              gather_output=True)
    _check_column(sub, full, rank, x)
    # row-parallel over a fused input (two sub-matrices of 6 and 4 input features)
    torch.manual_seed(0)
    row_full = nn.Linear(10, 5)
    row = SubParamLinearAllreduce(copy.deepcopy(row_full), group, shape=(-1, (6, 4)), name="o")
    x_full = torch.randn(3, 10, generator=torch.Generator().manual_seed(2))
    x_local = shard(x_full, TPShardSpec((3, 10), 1, row.shard_specs()["weight"].widths), rank)  # input: as W's dim 1
    torch.testing.assert_close(row(x_local), row_full(x_full), **TOL)
    return [q_heads, kv_heads]


def test_fused_qkv_uneven_gqa_tp2() -> None:
    # 6 query heads in 3 kv groups over 2 ranks: rank 0 gets 2 groups (4 q, 2 kv heads), rank 1 one group
    assert run_distributed(_fused, 2, 3, 6, timeout=90) == [[4, 2], [2, 1]]


def test_fused_qkv_tp4() -> None:
    assert run_distributed(_fused, 4, 4, 8, timeout=120) == [[2, 1]] * 4


def _errors() -> list[str]:
    group = comm.world_group()
    out = []
    cases = [
        lambda: LinearLayer(nn.Linear(4, 3), group, name="h.0.mlp.c_fc"),
        lambda: LinearAllreduce(nn.Linear(2, 5), group, name="h.0.attn.c_proj"),
        lambda: FusedQKVLinear(nn.Linear(4, 16), group, num_heads=4, num_kv_heads=2, name="h.0.attn.qkv"),
        lambda: VocabParallelEmbedding(nn.Embedding(3, 2), group, name="wte"),
    ]
    for make in cases:
        with pytest.raises(ShardSizeError) as info:
            make()
        out.append(str(info.value))
    col = LinearLayer(nn.Linear(4, 8), group, sequence_parallel=True, name="seq")
    with pytest.raises(ValueError, match="reduce_scatter|sequence"):
        LinearAllreduce(nn.Linear(8, 4), group, sequence_parallel=True)(torch.randn(1, 6, 2))
    assert col(torch.randn(1, 2, 4)).shape == (1, 8, 2)   # 2 tokens per rank gathered to 8
    return out


def test_unsplittable_sizes_name_layer_and_numbers_tp4() -> None:
    msgs = run_distributed(_errors, 4, timeout=90)[0]
    assert "layer 'h.0.mlp.c_fc': output features of 3" in msgs[0] and "size 4" in msgs[0]
    assert "layer 'h.0.attn.c_proj': input features of 2" in msgs[1]
    assert "layer 'h.0.attn.qkv': 2 key/value heads cannot be split over tensor-parallel size 4" in msgs[2]
    assert "layer 'wte': vocabulary rows of 3" in msgs[3] and "[1, 1, 1, 0]" in msgs[3]
