"""Tensor-parallel layers without a group (``mp_group=None``: tensor-parallel size 1) behave exactly like the
modules they wrap and never communicate; DeepSpeed's ``shape`` spec and names; cross-entropy edge cases."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.module_inject.layers import (FusedQKVLinear, LinearAllreduce, LinearLayer, SubParamLinearLayer,
                                            VocabParallelEmbedding, VocabParallelLinear, fused_LinearLayer)
from zerospeed.parallel.tensor import tp_shard_specs, vocab_parallel_cross_entropy


def test_no_group_is_the_plain_module() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(5, 7)
    x = torch.randn(2, 3, 5)
    for layer in (LinearLayer(copy.deepcopy(lin), None, gather_output=True, overlap_comm=True, sequence_parallel=True),
                  LinearAllreduce(copy.deepcopy(lin), None, sequence_parallel=True),
                  LinearLayer.from_weights(weight=lin.weight.detach().clone(), bias=lin.bias.detach().clone())):
        assert layer.tp_world_size == 1 and layer.weight.shape == (7, 5)
        torch.testing.assert_close(layer(x), lin(x), rtol=0, atol=0)
    emb = nn.Embedding(9, 4, padding_idx=2)
    vp = VocabParallelEmbedding(copy.deepcopy(emb), None)
    ids = torch.tensor([[0, 2, 8]])
    torch.testing.assert_close(vp(ids), emb(ids), rtol=0, atol=0)
    assert vp.padding_idx == 2 and (vp.vocab_start_index, vp.vocab_end_index) == (0, 9)


def test_specs_by_parameter_name() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    model[0] = LinearLayer(model[0], None, name="fc")
    model[1] = LinearAllreduce(model[1], None, name="proj")
    specs = tp_shard_specs(model)
    assert set(specs) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert specs["0.weight"].dim == 0 and specs["1.weight"].dim == 1 and specs["1.bias"].dim is None
    assert specs["0.weight"].full_shape == (6, 4)


def test_shape_spec_and_names() -> None:
    sub = SubParamLinearLayer(nn.Linear(4, 12), None, shape=((6, 3, 3), -1), name="c_attn")
    assert sub.subparam_sizes == (6, 3, 3) and sub.local_subparam_sizes() == (6, 3, 3)
    assert SubParamLinearLayer(nn.Linear(4, 12), None, shape=(3, 4)).subparam_sizes == (4, 4, 4)
    with pytest.raises(ValueError, match="sub-parameter sizes \\(6, 3, 2\\) do not tile a dimension of 12"):
        SubParamLinearLayer(nn.Linear(4, 12), None, shape=((6, 3, 2), -1), name="c_attn")
    with pytest.raises(ValueError, match="not supported yet by zerospeed"):
        SubParamLinearLayer(nn.Linear(4, 12), None, shape=(2, 3, -1))
    with pytest.raises(ValueError, match="12 output rows are not"):
        FusedQKVLinear(nn.Linear(4, 12), None, num_heads=4, num_kv_heads=3, name="qkv")
    with pytest.raises(NotImplementedError, match="fused_LinearLayer .* not supported yet by zerospeed"):
        fused_LinearLayer(nn.Linear(4, 12), None)
    with pytest.raises(ValueError, match="max_norm"):
        VocabParallelEmbedding(nn.Embedding(5, 2, max_norm=1.0), None)
    head = VocabParallelLinear(nn.Linear(4, 10, bias=False), None, name="lm_head")
    assert head.vocab_size == 10 and head.vocab_end_index == 10


def test_cross_entropy_without_group() -> None:
    logits = torch.randn(2, 5, 7, requires_grad=True)
    target = torch.randint(0, 7, (2, 5))
    target[0, 1] = -100
    ref = F.cross_entropy(logits.view(-1, 7), target.view(-1))
    got = vocab_parallel_cross_entropy(logits, target)
    torch.testing.assert_close(got, ref)
    g_ref, = torch.autograd.grad(ref, logits)
    g, = torch.autograd.grad(got, logits)
    torch.testing.assert_close(g, g_ref)
    all_ignored = torch.full((2, 5), -100)
    assert vocab_parallel_cross_entropy(logits, all_ignored).item() == 0.0   # DeepSpeed: 0, not nan
    with pytest.raises(ValueError, match="outside the vocabulary of 7"):
        vocab_parallel_cross_entropy(logits, torch.full((2, 5), 7))
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_cross_entropy(logits, target, reduction="avg")
