"""Serving engine: many concurrent requests under a small token budget give HF generate's greedy tokens."""

import pytest
import torch

from zerospeed.config import ConfigError, NotSupportedYetError
from zerospeed.inference.sampling import SamplingParams, filter_logits
from zerospeed.inference.serving import QueueFullError, ServingEngine
from zerospeed.models.gpt import GPT, tiny

transformers = pytest.importorskip("transformers")

V = 97


def _cfg(tokens=8, seqs=4, tracked=16, blocks=64, block=4):
    return {"state_manager": {"max_ragged_batch_size": tokens, "max_ragged_sequence_count": seqs,
                              "max_tracked_sequences": tracked, "max_context": 64, "kv_block_size": block,
                              "memory_config": {"mode": "allocate", "size": blocks}}}


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.3,
                                  eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_concurrent_requests_match_hf_one_by_one(build):
    model = build()
    g = torch.Generator().manual_seed(2)
    lengths, new = [1, 13, 4, 9, 21, 6], [7, 3, 9, 5, 4, 8]
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
    eng = ServingEngine(model, _cfg(tokens=8, seqs=4, blocks=40))
    reqs = eng.generate(prompts, [SamplingParams(max_tokens=n) for n in new])
    for p, n, r in zip(prompts, new, reqs):
        ref = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
        assert r.output == ref and r.finish_reason == "length"
    # the budget was honoured and prompts were split: more forwards than the longest generation
    assert eng.forwards > max(new) and eng.tokens_forwarded == sum(lengths) + sum(new) - len(new)
    assert eng.scheduler.allocator.num_free == 40 and not eng.requests


def test_cancel_frees_blocks_and_others_continue():
    model = GPT(tiny(), seed=1).eval()
    eng = ServingEngine(model, _cfg(tokens=16, blocks=12))
    a = eng.add_request(list(range(10)), SamplingParams(max_tokens=6))
    b = eng.add_request(list(range(5)), SamplingParams(max_tokens=6))
    eng.step()
    used = 12 - eng.scheduler.allocator.num_free
    assert used >= 2
    eng.cancel(a)
    assert eng.scheduler.allocator.num_free == 12 - len(eng.scheduler.running[b].blocks)
    out = []
    while eng.has_work:
        out += [e.token for e in eng.step()]
    ref = ServingEngine(model, _cfg(tokens=16, blocks=12)).generate([list(range(5))], SamplingParams(max_tokens=6))
    assert len(out) == 5 and ref[0].output[1:] == out  # b's first token came in the first step
    assert eng.scheduler.allocator.num_free == 12


def test_stop_tokens_strings_and_queue_limit():
    model = _gpt2()
    decode = lambda ids: "".join(chr(33 + i) for i in ids)  # noqa: E731  one character per token
    eng = ServingEngine(model, _cfg(seqs=2, tracked=2), decode=decode)
    free = eng.generate([[65, 66]], SamplingParams(max_tokens=8))[0]
    k = next(i for i, t in enumerate(free.output) if t not in free.output[:i] and i >= 2)
    stop_tok = eng.generate([[65, 66]], SamplingParams(max_tokens=8, stop_token_ids=(free.output[k],)))[0]
    assert stop_tok.output == free.output[:k + 1] and stop_tok.finish_reason == "stop"
    text = decode(free.output)
    stop_str = eng.generate([[65, 66]], SamplingParams(max_tokens=8, stop=(text[k:k + 2],)))[0]
    assert stop_str.finish_reason == "stop" and stop_str.text == text[:text.find(text[k:k + 2])]
    assert len(stop_str.output) < 8 and free.finish_reason == "length" and free.text == text
    eng.add_request([1], SamplingParams(max_tokens=2))
    eng.add_request([1], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        eng.add_request([1], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_context"):
        ServingEngine(GPT(tiny()), _cfg()).add_request([1] * 30, SamplingParams(max_tokens=5))  # 32 positions


def test_sampling_seeded_and_filters():
    model = GPT(tiny(), seed=1).eval()
    eng = ServingEngine(model, _cfg())
    p = SamplingParams(max_tokens=10, temperature=1.3, top_k=20, top_p=0.9, seed=5)
    a, b = eng.generate([[1, 2, 3], [1, 2, 3]], p)
    c = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=10, temperature=1.3, seed=6))[0]
    assert a.output == b.output != c.output
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [False, False, True, True, True]
    probs = logits.softmax(-1)  # 0.64, 0.24, ...: top_p=0.7 keeps the first two
    assert probs[0] < 0.7 < probs[:2].sum()
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.7)).tolist() == [False, False, True, True, True]
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.1)).tolist() == [False, True, True, True, True]
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_fastgen_config_limits():
    model = GPT(tiny()).eval()
    with pytest.raises(ConfigError, match="max_ragged_sequence_count"):
        ServingEngine(model, {"state_manager": {"max_ragged_sequence_count": 10, "max_ragged_batch_size": 5}})
    with pytest.raises(NotSupportedYetError, match="memory_config.mode"):
        ServingEngine(model)  # DeepSpeed's default 'reserve' mode is not built
    with pytest.raises(ValueError, match="needs the process group"):
        ServingEngine(model, {"tensor_parallel": {"tp_size": 2}, **_cfg()})  # tp > 1: tests/dist/test_serving_tp.py
