"""Speculative decoding by prompt lookup: greedy output token-identical to plain decoding (with eos, stop
ids and max_tokens landing inside a draft), and rejection sampling that keeps the target distribution."""

import pytest
import torch

from zerospeed.inference.sampling import SamplingParams, target_probs
from zerospeed.inference.serving import ServingEngine
from zerospeed.inference.speculative import SpeculativeConfig, propose_ngram, verify
from zerospeed.models.gpt import GPT, GPTConfig


def _engine(model, spec, eos=()):
    cfg = {"state_manager": {"memory_config": {"mode": "allocate", "size": 64}, "kv_block_size": 8,
                             "max_ragged_batch_size": 64, "max_ragged_sequence_count": 8, "max_tracked_sequences": 8}}
    return ServingEngine(model, cfg, speculative=spec, eos_token_ids=eos)


def test_propose_ngram():
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], cfg, 4) == [3, 1, 2, 3]
    assert propose_ngram([7, 8, 9, 1, 2], cfg, 4) == []
    assert propose_ngram([1, 2, 9, 5, 1, 2], cfg, 2) == [9, 5]  # the limit (room left) wins
    assert SpeculativeConfig.parse({"model": "/some/dir", "num_speculative_tokens": 2}).model == "/some/dir"
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="eagle.*not supported yet"):
        SpeculativeConfig.parse({"method": "eagle", "model": "/d", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokenz": 2})


def test_greedy_identical_with_fewer_forwards():
    model = GPT(GPTConfig(block_size=256, n_layer=2, n_head=2, n_embd=32), seed=5).eval()
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (12,), generator=g).tolist()
    prompts = [base * 4, torch.randint(0, 256, (30,), generator=g).tolist(), base * 2 + [1, 2, 3]]
    plain = _engine(model, None).generate(prompts, SamplingParams(max_tokens=40))
    loop_token = plain[0].output[20]
    for spec in ({"num_speculative_tokens": 4}, {"num_speculative_tokens": 2, "prompt_lookup_max": 2}):
        eng = _engine(model, spec)
        got = eng.generate(prompts, SamplingParams(max_tokens=40))
        assert [r.output for r in got] == [r.output for r in plain]
        assert eng.accepted > 20 and eng.forwards < 35 and eng.scheduler.allocator.num_free == 64
        for stops in (dict(stop_token_ids=(loop_token,)),):  # a stop id inside a draft ends there
            a = _engine(model, None).generate(prompts, SamplingParams(max_tokens=40, **stops))
            b = _engine(model, spec).generate(prompts, SamplingParams(max_tokens=40, **stops))
            assert [(r.output, r.finish_reason) for r in a] == [(r.output, r.finish_reason) for r in b]
        a = _engine(model, None, eos=(loop_token,)).generate(prompts, SamplingParams(max_tokens=37))
        b = _engine(model, spec, eos=(loop_token,)).generate(prompts, SamplingParams(max_tokens=37))
        assert [(r.output, r.finish_reason) for r in a] == [(r.output, r.finish_reason) for r in b]


def test_rejection_sampling_keeps_the_target_distribution():
    torch.manual_seed(0)
    rows = torch.randn(3, 5) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4, seed=1)
    p0, p1 = target_probs(rows[0], params), target_probs(rows[1], params)
    drafts = [int(p0.argsort()[-2]), int(p1.argmax())]  # a plausible but not the likeliest first draft
    gen = torch.Generator().manual_seed(3)
    n = 8000
    first = torch.zeros(5)
    second = torch.zeros(5)
    for _ in range(n):
        out = verify(rows, drafts, params, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    assert torch.allclose(first / n, p0, atol=0.025), (first / n, p0)
    assert torch.allclose(second / second.sum(), p1, atol=0.045), (second / second.sum(), p1)


def test_draft_model_greedy_identical_and_its_cache_follows_the_target():
    """A draft model's greedy drafts: output token-identical to plain decoding; with the target as its own
    draft every draft is accepted (so the draft's cache holds exactly the accepted tokens after each round);
    a smaller unrelated draft still changes nothing; finished requests give their draft blocks back."""
    target = GPT(GPTConfig(block_size=256, n_layer=3, n_head=2, n_embd=32), seed=5).eval()
    small = GPT(GPTConfig(block_size=256, n_layer=1, n_head=2, n_embd=16), seed=9).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 30)]
    plain = _engine(target, None).generate(prompts, SamplingParams(max_tokens=24))
    for draft, k in ((target, 4), (small, 3)):
        eng = _engine(target, {"model": draft, "num_speculative_tokens": k})
        got = eng.generate(prompts, SamplingParams(max_tokens=24))
        assert [r.output for r in got] == [r.output for r in plain]
        assert eng.drafted > 0 and eng.proposer.forwards > 0
        if draft is target:
            assert eng.accepted == eng.drafted and eng.forwards <= 3 + 24 // (k + 1) + 2
        eng.proposer.propose([], ())  # nothing live: every request's draft blocks come back
        assert eng.proposer.allocator.num_free == eng.proposer.allocator.num_blocks
    with pytest.raises(ValueError, match="vocabulary"):
        _engine(target, {"model": GPT(GPTConfig(vocab_size=100, n_layer=1, n_head=2, n_embd=16)),
                         "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="cannot load the draft model"):
        _engine(target, {"model": "/nonexistent/draft", "num_speculative_tokens": 2})


def test_draft_model_sampling_keeps_seeded_requests_reproducible():
    target = GPT(GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=32), seed=2).eval()
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=11)
    spec = {"model": target, "num_speculative_tokens": 3}
    a = _engine(target, spec).generate([[1, 2, 3]], params)[0].output
    b = _engine(target, spec).generate([[1, 2, 3]], params)[0].output
    assert a == b and len(a) == 16


def test_speculation_through_the_openai_client(tmp_path):
    """The official ``openai`` client against a server whose engine drafts (n-gram, then a draft model): greedy
    completions equal a server's without speculation, and the drafts were used."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient

    from zerospeed.inference.model_dir import load_model_dir, save_gpt_dir
    from zerospeed.inference.server import create_app

    loaded = load_model_dir(save_gpt_dir(GPT(GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=32), seed=5),
                                         tmp_path / "tiny"))
    texts = {}
    for name, spec in (("plain", None), ("ngram", {"num_speculative_tokens": 3}),
                       ("draft", {"model": loaded.model, "num_speculative_tokens": 3})):
        engine = _engine(loaded.model, spec)
        with TestClient(create_app(loaded, engine)) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
            texts[name] = client.completions.create(model="tiny", prompt="abcabcabcabc", max_tokens=24,
                                                    temperature=0).choices[0].text
        assert spec is None or engine.accepted > 0, name
    assert texts["ngram"] == texts["plain"] == texts["draft"]
