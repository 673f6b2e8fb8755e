"""init_inference + KV-cache generate: token-for-token equal to Hugging Face generate (fp32), prompt run once."""

import pytest
import torch

import zerospeed
from zerospeed.config import NotSupportedYetError
from zerospeed.models.gpt import GPT, tiny

transformers = pytest.importorskip("transformers")

from .hf_tiny import V, gpt2 as _gpt2, llama as _llama


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_greedy_matches_hf_generate(build):
    model = build()
    ids = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert len(set(ref[:, 6:].flatten().tolist())) > 3, "model too degenerate for a meaningful parity test"
    out = zerospeed.init_inference(model, dtype=torch.float32).generate(ids, max_new_tokens=10)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_left_padded_batch_matches_rows_alone(build):
    model = build()
    eng = zerospeed.init_inference(model, dtype="fp32")
    a, b = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[11, 12]])
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 0, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=6)
    assert torch.equal(out[0, 5:], model.generate(a, max_new_tokens=6)[0, 5:])
    assert torch.equal(out[1, 5:], model.generate(b, max_new_tokens=6)[0, 2:])
    with pytest.raises(NotSupportedYetError, match="right padding"):
        eng.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]), max_new_tokens=2)


def test_prompt_runs_once_then_one_token_per_step():
    model = GPT(tiny(), seed=3).eval()
    eng = zerospeed.init_inference(model, dtype="fp32")
    seen = []
    real = eng.adapter.hidden
    eng.adapter.hidden = lambda ids, pos, attend: (seen.append(ids.numel()), real(ids, pos, attend))[1]
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    out = eng.generate(ids, max_new_tokens=7)
    assert seen == [18] + [2] * 6  # prefill both prompts once, then one new token per sequence per step
    x = ids.clone()  # reference: full recompute, no cache
    for _ in range(7):
        x = torch.cat([x, model(x)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, x)


def test_eos_stops_and_pads_like_hf():
    model = _gpt2()
    ids = torch.tensor([[1, 2, 3]])
    ref = model.generate(ids, max_new_tokens=8)
    eos = int(ref[0, 5])  # the third generated token becomes the eos
    ref2 = model.generate(torch.cat([ids, ids + 1]), max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
    out = zerospeed.init_inference(model, dtype="fp32").generate(torch.cat([ids, ids + 1]), max_new_tokens=8,
                                                                 eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref2)


def test_forward_is_the_models_and_limits_are_checked():
    model = GPT(tiny()).eval()
    eng = zerospeed.init_inference(model, config={"dtype": "fp32", "max_out_tokens": 12})
    ids = torch.randint(0, 256, (1, 8))
    assert torch.equal(eng(ids)[0], model(ids)[0])
    with pytest.raises(ValueError, match="max_out_tokens=12"):
        eng.generate(ids, max_new_tokens=5)
    with pytest.raises(NotSupportedYetError, match="repetition_penalty"):
        eng.generate(ids, max_new_tokens=2, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="tp_size=2 needs the process group"):
        zerospeed.init_inference(model, tensor_parallel={"tp_size": 2})
    with pytest.raises(ValueError, match="disagree"):
        zerospeed.init_inference(model, tensor_parallel={"tp_size": 2}, mp_size=4)


def test_unsupported_model_named():
    with pytest.raises(NotSupportedYetError, match="Sequential"):
        zerospeed.init_inference(torch.nn.Sequential(torch.nn.Linear(2, 2)), dtype="fp32").generate(
            torch.zeros(1, 2, dtype=torch.long), max_new_tokens=1)


def test_sampling_is_seeded():
    eng = zerospeed.init_inference(GPT(tiny()), dtype="fp32")
    ids = torch.tensor([[1, 2, 3]])
    a = eng.generate(ids, max_new_tokens=8, do_sample=True, temperature=1.5, seed=7)
    b = eng.generate(ids, max_new_tokens=8, do_sample=True, temperature=1.5, seed=7)
    c = eng.generate(ids, max_new_tokens=8, do_sample=True, temperature=1.5, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
