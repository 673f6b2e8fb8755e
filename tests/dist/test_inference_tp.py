"""Tensor-parallel inference at tp=2 on Gloo ranks: greedy tokens equal tp=1 and Hugging Face generate (GPT-2,
Llama with GQA, zerospeed's GPT); each rank holds half of every attention/MLP matrix and half the KV heads."""

from __future__ import annotations

import copy

import pytest
import torch

import zerospeed
from zerospeed.models.gpt import GPT, GPTConfig
from zerospeed.parallel.tensor import FusedQKVLinear, LinearAllreduce, LinearLayer
from zerospeed.testing import run_distributed

transformers = pytest.importorskip("transformers")

from ..unit.hf_tiny import V, gpt2 as _gpt2, llama as _llama


def _gpt():
    return GPT(GPTConfig(vocab_size=V, block_size=64, n_layer=2, n_head=4, n_embd=32), seed=0).eval()


def _rank() -> dict:
    out = {}
    ids = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(1))
    for name, build in (("gpt2", _gpt2), ("llama", _llama), ("gpt", _gpt)):
        model = build()
        ref = zerospeed.init_inference(copy.deepcopy(model), dtype="fp32").generate(ids, max_new_tokens=10)
        eng = zerospeed.init_inference(model, dtype="fp32", tensor_parallel={"tp_size": 2, "tp_grain_size": 8})
        tp = eng.generate(ids, max_new_tokens=10)
        cut = [m for m in model.modules() if isinstance(m, (FusedQKVLinear, LinearLayer, LinearAllreduce))]
        full = build()
        out[name] = {"equal_tp1": torch.equal(tp, ref), "tokens": tp.tolist(), "layers_cut": len(cut),
                     "heads": (eng.adapter.num_heads, eng.adapter.num_kv_heads),
                     "params": sum(p.numel() for p in model.parameters()),
                     "full_params": sum(p.numel() for p in full.parameters())}
        if name == "gpt2":
            hf = full.generate(ids, max_new_tokens=10, do_sample=False)
            out[name]["equal_hf"] = torch.equal(tp, hf)
        if name == "llama":
            out[name]["equal_hf"] = torch.equal(tp, full.generate(ids, max_new_tokens=10, do_sample=False))
    return out


def test_tp2_greedy_equals_tp1_and_hf() -> None:
    results = run_distributed(_rank, 2, timeout=120)
    for name, cut, heads in (("gpt2", 8, (2, 2)), ("llama", 14, (2, 1)), ("gpt", 8, (2, 2))):
        per = [r[name] for r in results]
        assert all(p["equal_tp1"] for p in per), name
        assert per[0]["tokens"] == per[1]["tokens"]
        assert all(p["layers_cut"] == cut and p["heads"] == heads for p in per), per
        assert all(p["params"] < p["full_params"] for p in per)  # each rank holds a slice, not the whole model
    assert results[0]["gpt2"]["equal_hf"] and results[0]["llama"]["equal_hf"]
