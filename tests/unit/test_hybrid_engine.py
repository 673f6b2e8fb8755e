"""The hybrid engine without processes: its config keys, the length bound, the phase's KV cache, clear refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from zerospeed.config import load_config
from zerospeed.config.errors import NotSupportedYetError
from zerospeed.config.hybrid_engine import HybridEngineConfig
from zerospeed.runtime.hybrid_engine import HybridEngine


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2, eos_token_id=33,
                                      pad_token_id=0))


def test_config_keys() -> None:
    cfg = load_config({"train_batch_size": 1, "hybrid_engine": {"enabled": True, "max_out_tokens": 64,
                                                               "tp_gather_partition_size": 4}})
    assert (cfg.hybrid_engine.max_out_tokens, cfg.hybrid_engine.pin_parameters) == (64, True)
    assert load_config({"train_batch_size": 1, "hybrid_engine": {"inference_tp_size": 2}}).hybrid_engine.inference_tp_size == 2
    with pytest.raises(NotSupportedYetError, match="CUDA graphs .* never on CPU"):
        load_config({"train_batch_size": 1, "hybrid_engine": {"enabled": True, "enable_cuda_graph": True}})


def test_phase_cache_and_length_bound() -> None:
    model = _model().train()
    he = HybridEngine(HybridEngineConfig(enabled=True, max_out_tokens=12), model)
    ids = torch.randint(1, 32, (2, 4), generator=torch.Generator().manual_seed(1))
    out = he.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, model.eval().generate(ids, max_new_tokens=5, do_sample=False))
    model.train()
    assert model.training and he.in_phase and list(he.caches) == [2]  # the cache lives for the phase
    cache = he.caches[2]
    he.generate(ids, max_new_tokens=5, do_sample=False)
    assert he.caches[2] is cache  # reused, not reallocated
    he.end_phase()
    assert not he.in_phase
    with pytest.raises(ValueError, match="max_out_tokens = 12"):
        he.generate(ids, max_new_tokens=9)
    with pytest.raises(ValueError, match="Hugging Face generate"):
        HybridEngine(HybridEngineConfig(enabled=True), nn.Linear(2, 2))


def test_release_hands_the_host_heap_back(monkeypatch) -> None:
    """release_inference_cache on the host: the freed weights and cache are trimmed out of the heap (glibc keeps
    freed pages resident otherwise: the RSS after a rollout fell from ~290 to 31 MiB over start with it,
    docs/benchmarks.md)."""
    import zerospeed.runtime.hybrid_engine as hybrid

    trims: list[int] = []
    monkeypatch.setattr(hybrid, "malloc_trim", lambda: trims.append(1) or True)
    he = HybridEngine(HybridEngineConfig(enabled=True, max_out_tokens=12, release_inference_cache=True), _model())
    he.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, do_sample=False)
    assert trims == [1] and not he.in_phase
