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


def test_decode_attention_matches_per_sequence_sdpa_in_every_layout():
    """Decodes attend in one scaled ``baddbmm`` per length group after one gather for all groups, the mask one
    row per (sequence, kv head): equal to plain per-sequence attention whether the decodes fill the whole
    batch sorted by length (written in place through a slice) or not, come first, or sit between prompt chunks
    (an index), with one, two or many length groups."""
    import torch.nn.functional as F

    from zerospeed.inference.kv_cache import PagedKVCache, RaggedBatch, SeqChunk

    torch.manual_seed(0)
    heads, kv, dim, size = 4, 2, 8, 4
    cache = PagedKVCache(1, 40, size, kv, dim, torch.float32)
    k0, v0 = torch.randn(160, kv, dim), torch.randn(160, kv, dim)
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(5)]
    lens = (3, 30, 5, 27, 2)  # short and long cached lengths: two length groups
    prefill = RaggedBatch(torch.zeros(sum(lens), dtype=torch.long), [SeqChunk(t, 0, n) for t, n in zip(tables, lens)])
    q0 = torch.randn(sum(lens), heads, dim)
    cache.attention(prefill)(0, q0, k0[:sum(lens)], v0[:sum(lens)], 0.3)
    layouts = {
        "decodes only": [SeqChunk(t, n, 1) for t, n in zip(tables, lens)],
        "decodes sorted": sorted([SeqChunk(t, n, 1) for t, n in zip(tables, lens)], key=lambda c: c.start),
        "decodes first": [SeqChunk(t, n, 1) for t, n in zip(tables[:4], lens[:4])] + [SeqChunk(tables[4], 2, 3)],
        "decodes between": [SeqChunk(tables[4], 2, 3)] + [SeqChunk(t, n, 1) for t, n in zip(tables[:4], lens[:4])],
    }
    assert len(cache._decode_groups(layouts["decodes only"], list(range(5)))) == 2
    for cost, name, chunks in [(c, n, x) for c in (1, 16, 10**6) for n, x in layouts.items()]:
        cache.GROUP_COST = cost  # 1: a group per distinct length; 10**6: one group
        total = sum(c.length for c in chunks)
        q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv, dim), torch.randn(total, kv, dim)
        got = cache.attention(RaggedBatch(torch.zeros(total, dtype=torch.long), chunks))(0, q, k, v, 0.3)
        at = 0
        for c in chunks:
            slots = cache.slots(c.block_table, 0, c.start + c.length)
            ks, vs = cache.k[0][:, slots][None], cache.v[0][:, slots][None]  # [1, Hkv, S, D], new keys included
            qs = q[at:at + c.length].transpose(0, 1)[None]
            causal = torch.ones(c.length, c.start + c.length, dtype=torch.bool).tril(c.start)
            want = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal, scale=0.3, enable_gqa=True)
            torch.testing.assert_close(got[at:at + c.length], want[0].transpose(0, 1), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
            at += c.length
    cache.GROUP_COST = 1
    chunks = layouts["decodes only"]
    groups = cache._decode_groups(chunks, list(range(5)))
    assert [m for m, _ in groups] == [[4, 0], [2], [3], [1]] and [n for _, n in groups] == [4, 6, 28, 31]
    ids, mask, plan = cache._decode_plan(chunks, groups)
    assert mask.shape == (5 * kv, 1, 32)  # one row per (sequence, kv head): broadcast over the query heads
    assert ids.numel() == kv * (2 * 1 + 2 + 7 + 8) and plan[1] == (4, 6, 4, 4, 8)  # each group at its width


def test_hooked_or_replaced_projections_still_run_as_modules():
    """The Llama out-projection and down-projection call ``F.linear`` directly only for plain hook-free
    ``nn.Linear`` layers: a forward hook still fires, and the tokens still equal Hugging Face's."""
    pytest.importorskip("transformers")
    from zerospeed.inference import SamplingParams, ServingEngine

    model = llama()
    prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    want = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, 6:].tolist()
    seen = []
    blk = model.model.layers[1]
    blk.self_attn.o_proj.register_forward_hook(lambda m, i, o: seen.append("o_proj"))
    blk.mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append("down_proj"))
    cfg = {"state_manager": {"max_ragged_batch_size": 16, "max_ragged_sequence_count": 2, "max_context": 32,
                             "kv_block_size": 4, "memory_config": {"mode": "allocate", "size": 8}}}
    eng = ServingEngine(model, cfg)
    assert eng.generate([prompt], SamplingParams(max_tokens=4))[0].output == want
    assert seen.count("o_proj") == 4 and seen.count("down_proj") == 4  # one forward per new token


def test_llama_rotary_table_grows_follows_inv_freq_and_matches_hf():
    """Llama's rotary cos/sin are rows of a table made by the model's own rotary module: the table grows past
    its first 256 positions, is rebuilt when ``inv_freq`` changes in place, and the tokens equal Hugging Face's."""
    pytest.importorskip("transformers")
    from zerospeed.inference import SamplingParams, ServingEngine

    model = llama()
    prompt = torch.randint(0, V, (250,), generator=torch.Generator().manual_seed(3)).tolist()
    want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 250:].tolist()
    cfg = {"state_manager": {"max_ragged_batch_size": 128, "max_ragged_sequence_count": 2, "max_context": 512,
                             "kv_block_size": 16, "memory_config": {"mode": "allocate", "size": 32}}}
    eng = ServingEngine(model, cfg)
    assert eng.generate([prompt], SamplingParams(max_tokens=12))[0].output == want  # positions 0..261
    table = eng.adapter._rope
    assert table is not None and table[1].shape[0] == 512
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(2.0)  # in place: the table must follow
    want = model.generate(torch.tensor([prompt[:20]]), max_new_tokens=5, do_sample=False)[0, 20:].tolist()
    assert eng.generate([prompt[:20]], SamplingParams(max_tokens=5))[0].output == want
    assert eng.adapter._rope is not table
