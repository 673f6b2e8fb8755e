"""Fused q/k/v and gate/up matmuls on the model's own weights (no second copy), and the serving engine's
batched decode attention (grouped heads, padded reads cut into length groups) against Hugging Face."""

import pytest
import torch
from torch import nn

from zerospeed.inference.fused_weights import FusedLinears

from .hf_tiny import V, llama


def test_fused_linears_share_storage_and_fall_back():
    torch.manual_seed(0)
    mods = (nn.Linear(8, 6), nn.Linear(8, 2), nn.Linear(8, 2))
    before = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in mods]
    x = torch.randn(3, 8)
    want = [m(x) for m in mods]
    fused = FusedLinears.build(mods)
    assert fused is not None and fused.valid(mods)
    for m, (w, b) in zip(mods, before):  # same values, now slices of one buffer: no second copy
        assert torch.equal(m.weight, w) and torch.equal(m.bias, b)
        assert m.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(fused(x), want))
    with torch.no_grad():
        mods[1].weight.copy_(torch.ones(2, 8))  # an in-place load reaches the buffer
    assert torch.allclose(fused(x)[1], mods[1](x))
    mods[2].weight = nn.Parameter(torch.zeros(2, 8))  # re-assigned: no longer fused
    assert not fused.valid(mods)
    assert not fused.valid((mods[0], mods[1], nn.Linear(8, 2)))
    assert FusedLinears.build((nn.Linear(8, 2), nn.Linear(8, 2, bias=False))) is None  # mixed bias
    hooked = nn.Linear(8, 2)
    hooked.register_forward_hook(lambda *a: None)
    assert FusedLinears.build((hooked, nn.Linear(8, 2))) is None


def test_serving_llama_fused_and_length_groups_match_hf():
    pytest.importorskip("transformers")
    from zerospeed.inference import SamplingParams, ServingEngine

    model = llama()
    g = torch.Generator().manual_seed(5)
    lens = (2, 3, 30, 4, 28, 1)  # short and long: decode reads split into two length groups
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    want = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    cfg = {"state_manager": {"max_ragged_batch_size": 64, "max_ragged_sequence_count": 8, "max_context": 64,
                             "kv_block_size": 4, "memory_config": {"mode": "allocate", "size": 64}}}
    eng = ServingEngine(model, cfg)
    assert len(eng.adapter._fused) == 4  # q/k/v and gate/up of both blocks
    groups = []
    real = eng.cache._decode_groups
    eng.cache._decode_groups = lambda chunks, idx: groups.append(real(chunks, idx)) or groups[-1]
    got = [r.output for r in eng.generate(prompts, SamplingParams(max_tokens=6))]
    assert got == want
    assert max(len(x) for x in groups) == 2
