"""Beam search over the paged KV cache: token-for-token equal to Hugging Face generate(num_beams=K) (fp32)."""

import pytest
import torch

import zerospeed
from zerospeed.config import NotSupportedYetError

transformers = pytest.importorskip("transformers")

from .hf_tiny import V, gpt2 as _gpt2, llama as _llama


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_beam_search_equals_hf(build):
    model = build()
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    eng = zerospeed.init_inference(model, dtype="fp32")
    plain = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False)
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert not torch.equal(plain, greedy), "beam search should differ from greedy on this model"
    eos = int(plain[1, 6 + 3])  # a token the best beam emits: finished hypotheses really happen
    pad = next(t for t in range(1, V) if t not in ids.tolist()[0] + ids.tolist()[1])  # HF masks pads in prompts
    assert 0 not in ids
    cases = [{"num_beams": 3}, {"num_beams": 4, "num_return_sequences": 3},
             {"num_beams": 3, "eos_token_id": eos, "pad_token_id": pad},
             {"num_beams": 3, "eos_token_id": eos, "pad_token_id": 0, "length_penalty": 0.5, "early_stopping": True},
             {"num_beams": 2, "eos_token_id": [eos, 7], "pad_token_id": pad, "early_stopping": "never",
              "length_penalty": 2.0}]
    for kw in cases:
        ref = model.generate(ids, max_new_tokens=8, do_sample=False, **kw)
        out = eng.generate(ids, max_new_tokens=8, **kw)
        assert out.shape == ref.shape and torch.equal(out, ref), (kw, ref, out)
    assert (eng.generate(ids, max_new_tokens=8, **cases[2]) == eos).any()


def test_beam_search_refusals():
    eng = zerospeed.init_inference(_gpt2(), dtype="fp32")
    ids = torch.tensor([[1, 2, 3], [0, 4, 5]])
    with pytest.raises(NotSupportedYetError, match="beam search over padded prompts"):
        eng.generate(ids, attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]), max_new_tokens=2, num_beams=2)
    with pytest.raises(NotSupportedYetError, match="beam sampling"):
        eng.generate(ids, max_new_tokens=2, num_beams=2, do_sample=True)
    with pytest.raises(NotSupportedYetError, match="num_return_sequences"):
        eng.generate(ids, max_new_tokens=2, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_return_sequences=3"):
        eng.generate(ids, max_new_tokens=2, num_beams=2, num_return_sequences=3)
