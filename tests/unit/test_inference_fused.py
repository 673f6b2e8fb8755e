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


def test_decode_gathers_reuse_workspace_buffers_and_match_hf():
    """Decode attention gathers whole KV blocks into the cache's persistent workspace: a second run of the
    same requests allocates nothing new and gives the same (Hugging Face) tokens."""
    pytest.importorskip("transformers")
    from zerospeed.inference import SamplingParams, ServingEngine

    model = llama()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 9, 2, 13)]
    want = [model.generate(torch.tensor([p]), max_new_tokens=7, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    cfg = {"state_manager": {"max_ragged_batch_size": 16, "max_ragged_sequence_count": 4, "max_context": 64,
                             "kv_block_size": 4, "memory_config": {"mode": "allocate", "size": 32}}}
    eng = ServingEngine(model, cfg)
    ws = eng.cache.workspace
    assert [r.output for r in eng.generate(prompts, SamplingParams(max_tokens=7))] == want
    allocated, nbytes = ws.allocations, ws.nbytes
    assert allocated >= 2 and nbytes > 0  # keys and values
    assert [r.output for r in eng.generate(prompts, SamplingParams(max_tokens=7))] == want
    assert ws.allocations == allocated and ws.nbytes == nbytes  # reused, not re-allocated


def test_workspace_views_grow_geometrically_and_keep_their_buffer():
    from zerospeed.inference.workspace import Workspace

    ws = Workspace(torch.float32)
    a = ws.view("k", (2, 3))
    assert a.shape == (2, 3) and a.is_contiguous() and ws.allocations == 1
    b = ws.view("k", (5,))  # smaller: same buffer
    assert b.data_ptr() == a.data_ptr() and ws.allocations == 1
    c = ws.view("k", (7,))  # larger: one new buffer, at least twice the old
    assert ws.allocations == 2 and ws.nbytes == 12 * 4
    ws.view("v", (1,))
    assert ws.allocations == 3 and c.numel() == 7


def test_rotary_in_three_ops_equals_rotate_half_form():
    from zerospeed.inference.adapters import _rotate

    torch.manual_seed(0)
    x, cos, sin = torch.randn(5, 6, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)  # Hugging Face's rotate_half
    signed = torch.cat((-sin[..., :4], sin[..., 4:]), dim=-1)
    assert torch.allclose(_rotate(x, cos, signed), x * cos + half * sin, atol=1e-6)
    assert not torch.allclose(_rotate(x, cos, sin), x * cos + half * sin, atol=1e-3)  # the sign matters
