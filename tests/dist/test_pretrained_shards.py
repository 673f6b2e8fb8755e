"""ZeRO-3 loading of a pretrained Hugging Face checkpoint: each rank reads only its own elements (no full copy),
and the gathered model equals the checkpoint."""

from __future__ import annotations

import pytest
import torch

from zerospeed.testing import run_distributed

pytest.importorskip("transformers")

CFG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _save(path: str) -> dict[str, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    model.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _load(path: str) -> dict:
    import zerospeed
    from zerospeed.integrations.transformers import from_pretrained
    from transformers import GPT2LMHeadModel

    model, stats = from_pretrained(GPT2LMHeadModel, path, CFG)
    partitioned = sum(1 for p in model.parameters() if p.numel() == 0)
    engine, *_ = zerospeed.initialize(model=model, config=CFG)
    full = engine._zero3_consolidated_16bit_state_dict()
    return {"read": stats.elements_read, "tensors": stats.tensors, "full": full, "partitioned": partitioned,
            "total_params": sum(s.numel for s in engine.zero3.shards)}


def test_each_rank_reads_its_shard_only(tmp_path) -> None:
    ref = _save(str(tmp_path))
    r0, r1 = run_distributed(_load, 2, str(tmp_path), timeout=120)
    assert r0["partitioned"] > 0  # built partitioned under zero.Init
    total = r0["total_params"]
    for r in (r0, r1):  # each rank read about half of the parameters (plus the buffers), never the whole model
        assert r["read"] < 0.6 * total, (r["read"], total)
    assert r0["read"] + r1["read"] >= total
    for k, v in r0["full"].items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0, msg=k)
    assert set(r0["full"]) == set(ref) and r1["full"] == {}
