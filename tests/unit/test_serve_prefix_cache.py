"""Prefix caching: shared prompt blocks keyed by chained hashes, ref-counted, LRU-evicted; greedy tokens equal
with caching on and off, and far fewer tokens are forwarded when prompts share a prefix."""

import random

import pytest
import torch

from zerospeed.inference.prefix_cache import PrefixCachingAllocator, block_hashes
from zerospeed.inference.sampling import SamplingParams
from zerospeed.inference.serving import ServingEngine
from zerospeed.models.gpt import GPT, GPTConfig


def _model():
    model = GPT(GPTConfig(block_size=256, n_layer=2, n_head=2, n_embd=32), seed=5).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model


def _engine(model, on, blocks=40):
    cfg = {"state_manager": {"memory_config": {"mode": "allocate", "size": blocks}, "kv_block_size": 8,
                             "max_ragged_batch_size": 64, "max_tracked_sequences": 8, "max_ragged_sequence_count": 3}}
    return ServingEngine(model, cfg, prefix_caching=on)


def test_allocator_refcounts_and_lru():
    a = PrefixCachingAllocator(4)
    keys = block_hashes(list(range(20)), 8)
    assert len(keys) == 2 and keys != block_hashes([0] * 8 + list(range(8, 20)), 8)[:2]
    assert block_hashes([1] * 8 + [2] * 8, 8)[1] != block_hashes([3] * 8 + [2] * 8, 8)[1]  # chained on the prefix
    b = a.allocate(2)
    a.register(b[0], keys[0])
    a.register(b[1], keys[1])
    assert a.match(keys) == (b, 0)
    a.take(b, 16, 8)  # a second user
    a.free(b)
    assert a.num_free == 2  # still referenced once
    a.free(b)
    assert a.num_free == 4 and a.match(keys) == (b, 2)  # idle but cached
    c = a.allocate(3)  # two never-used blocks first, then the least recently used cached one
    assert set(c) & set(b) == {b[0]} and a.match(keys) == ([], 0)
    with pytest.raises(ValueError, match="double free"):
        a.free([b[1]])


def test_greedy_equal_on_and_off_with_fewer_tokens():
    model = _model()
    g = random.Random(0)
    system = [g.randrange(256) for _ in range(100)]
    prompts = [system + [g.randrange(256) for _ in range(5 + i)] for i in range(6)]
    prompts += [system[:40] + [1, 2, 3], system[:17]]  # partial prefixes (the last token is always recomputed)
    outs, forwarded = {}, {}
    for on in (False, True):
        eng = _engine(model, on)
        first = eng.generate(prompts[:1], SamplingParams(max_tokens=8))
        rest = eng.generate(prompts, SamplingParams(max_tokens=8))
        outs[on] = [r.output for r in first + rest]
        forwarded[on] = eng.tokens_forwarded
        assert eng.scheduler.allocator.num_free == 40
    assert outs[True] == outs[False]
    assert forwarded[True] < forwarded[False] / 2
    queries, hits = eng.prefix_cache_stats()
    assert hits > 0.6 * queries
    eng = _engine(model, True)  # all at once: later requests wait for the first to compute the shared blocks
    assert [r.output for r in eng.generate(prompts, SamplingParams(max_tokens=8))] == outs[False][1:]
    queries, hits = eng.prefix_cache_stats()
    assert hits > 0.5 * queries, (queries, hits)


def test_random_traffic_with_cancels_and_eviction():
    """Small cache (eviction), random shared prefixes, random cancels: tokens equal, no block leaks."""
    model = _model()
    g = random.Random(1)
    bases = [[g.randrange(256) for _ in range(48)] for _ in range(3)]
    prompts = [g.choice(bases)[:g.randrange(9, 48)] + [g.randrange(256) for _ in range(g.randrange(1, 6))]
               for _ in range(16)]
    cuts = [g.choice([None, None, 1, 3]) for _ in prompts]
    results = {}
    for on in (False, True):
        eng = _engine(model, on, blocks=24)
        reqs, pending = {}, list(enumerate(prompts))
        while eng.has_work or pending:
            while pending and len(eng.requests) < 8:
                i, p = pending.pop(0)
                u = eng.add_request(p, SamplingParams(max_tokens=6))
                reqs[u] = (eng.requests[u], cuts[i])
            eng.step()
            for r, cut in reqs.values():
                if len(r.output) == cut and r.finish_reason is None:
                    eng.cancel(r.uid)  # cancelled at a fixed point of its own output: same on and off
        results[on] = {u: (r.output, r.finish_reason) for u, (r, _) in reqs.items()}
        assert eng.scheduler.allocator.num_free == 24 and not eng.requests
        assert not on or eng.prefix_cache_stats()[1] > 0
    assert results[True] == results[False]
