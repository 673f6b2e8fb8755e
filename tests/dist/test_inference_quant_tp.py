"""Weight-only INT8 / INT4 quantization together with tensor parallelism (tp=2, Gloo): each rank quantizes its
own shards; logits and greedy tokens match the tp=1 quantized model, in ``generate`` and in the serving engine,
and each rank holds about half the quantized attention/MLP bytes (measured from its tensors)."""

from __future__ import annotations

import copy

import pytest
import torch

from zerospeed.models.gpt import GPT, GPTConfig
from zerospeed.testing import run_distributed

transformers = pytest.importorskip("transformers")

from ..unit.hf_tiny import V, gpt2 as _gpt2, llama as _llama  # noqa: E402

QUANT = {  # q_groups 2: tp=1's groups lie inside each row shard, so every rank's codes are tp=1's
    "int8": {"weight": {"num_bits": 8, "q_type": "symmetric", "q_groups": 2}},
    "int4": {"weight": {"num_bits": 4, "q_type": "asymmetric", "q_groups": 2}},
    # per channel: a row shard's piece of each row gets its own scale (finer than tp=1's)
    "int8-per-channel": {"weight": {"num_bits": 8, "q_type": "symmetric", "q_groups": 1}},
}


def _gpt():
    return GPT(GPTConfig(vocab_size=V, block_size=64, n_layer=2, n_head=4, n_embd=32), seed=0).eval()


def _logits(eng, ids: list[int]) -> torch.Tensor:
    from zerospeed.inference.kv_cache import PagedKVCache, RaggedBatch, SeqChunk

    a = eng.adapter
    cache = PagedKVCache(a.num_layers, 4, 16, a.num_kv_heads, a.head_dim, a.dtype)
    batch = RaggedBatch(torch.tensor(ids), [SeqChunk((0, 1, 2, 3), 0, len(ids))])
    with torch.no_grad():
        return a.logits(a.hidden(batch.token_ids, batch.positions, cache.attention(batch)))


def _bytes(model) -> tuple[int, int]:
    """(all linear bytes, the LM head's) held by this rank."""
    from zerospeed.inference.quantization import model_bytes

    return model_bytes(model, linear_weights_only=True), model_bytes(model.lm_head, linear_weights_only=True)


def _rank() -> dict:
    return {(name, q): _case(build, quant) for name, build in (("gpt2", _gpt2), ("llama", _llama), ("gpt", _gpt))
            for q, quant in QUANT.items()}


def _case(build, quant) -> dict:
    from zerospeed import comm
    from zerospeed.inference import SamplingParams, ServingEngine, init_inference
    from zerospeed.inference.quantization import QuantizedLinear, QuantizedRowParallel

    model = build()
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    one = init_inference(copy.deepcopy(model), dtype="fp32", quant=quant)
    two = init_inference(model, dtype="fp32", quant=quant, tensor_parallel={"tp_size": 2, "tp_grain_size": 8})
    prompt = ids[0].tolist()
    ref = _logits(init_inference(build(), dtype="fp32"), prompt)
    out = {"max_diff": float((_logits(one, prompt) - _logits(two, prompt)).abs().max()),
           "quant_err": float((_logits(one, prompt) - ref).abs().max()), "scale": float(ref.abs().max()),
           "equal_generate": torch.equal(one.generate(ids, max_new_tokens=8), two.generate(ids, max_new_tokens=8)),
           "rows": sum(isinstance(m, QuantizedRowParallel) for m in model.modules()),
           "quantized": sum(isinstance(m, QuantizedLinear) for m in model.modules()),
           "bytes_tp1": _bytes(one.module), "bytes": _bytes(model)}
    cfg = {"state_manager": {"max_ragged_batch_size": 8, "max_ragged_sequence_count": 4, "max_context": 64,
                             "kv_block_size": 4, "memory_config": {"mode": "allocate", "size": 32}}}
    prompts = [prompt, prompt[:2], ids[1].tolist() * 2]
    serving = ServingEngine(two, cfg)
    if comm.get_rank() == 0:
        want = [r.output for r in ServingEngine(one, cfg).generate(prompts, SamplingParams(max_tokens=6))]
        out["equal_serving"] = [r.output for r in serving.generate(prompts, SamplingParams(max_tokens=6))] == want
        serving.shutdown()
    else:
        serving.run_worker()
    return out


def test_quantized_tp2_matches_tp1_quantized() -> None:
    results = run_distributed(_rank, 2, timeout=180)
    for key in results[0]:
        for r in (results[0][key], results[1][key]):
            assert r["rows"] == 4, key  # two row-parallel layers per block, all-reduced
            if key[1] != "int8-per-channel":  # the same codes: only fp rounding (the all-reduce's order) differs
                assert r["max_diff"] <= 1e-4 * r["scale"], (key, r)
                assert r["equal_generate"], key
            else:  # own scales per shard: tp=2 deviates from tp=1 less than quantizing deviates from fp32
                assert r["max_diff"] <= r["quant_err"], (key, r)
            all_tp1, head = r["bytes_tp1"]
            assert r["bytes"][1] == head  # the LM head stays whole
            # each rank holds about half the quantized block weights (INT8's row shards: one more scale per row)
            assert 0.45 <= (r["bytes"][0] - head) / (all_tp1 - head) <= 0.6, (key, r)
        if key[1] != "int8-per-channel":
            assert results[0][key]["equal_serving"], key
