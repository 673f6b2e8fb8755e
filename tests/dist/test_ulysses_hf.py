"""Ulysses for Hugging Face models: a tiny Llama with GQA (4 query / 2 key-value heads) registered through
UlyssesSPAttentionHF.register_with_transformers and fed by UlyssesSPDataLoaderAdapter trains at sp=2 and
sp=2 x dp=2 under ZeRO 1, 2 and 3 like one unsharded process (fp32 losses and gradient norms, rtol 1e-5)."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from zerospeed import comm
from zerospeed.runtime.sequence_parallel.ulysses_sp import (UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter,
                                                            sequence_mean_loss)
from zerospeed.testing import run_distributed

transformers = pytest.importorskip("transformers")

STEPS, MB, SEQ, LR, CLIP, VOCAB, SP = 10, 2, 8, 1e-3, 1.0, 64, 2


def _model(arch: str = "llama", kv_heads: int = 2) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, attn_implementation="sdpa")
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **common)
        cls = transformers.GPT2LMHeadModel
    else:
        config_cls, cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[arch]
        cfg = config_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, max_position_embeddings=64, **common)
    torch.manual_seed(0)
    return cls(cfg)


def _batch(step: int, n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(700 + step))


def _reference(dp: int, arch: str = "llama", kv_heads: int = 2) -> tuple[list[float], list[float]]:
    model = _model(arch, kv_heads)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(STEPS):
        x = _batch(step, MB * dp)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def _train(stage: int, arch: str = "llama", kv_heads: int = 2, variable: bool = False) -> dict:
    model = _model(arch, kv_heads)
    grid = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, MB, seq_length=SEQ,
                                                           seq_length_is_variable=variable)
    config = {"train_micro_batch_size_per_gpu": MB, "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    engine, *_ = zerospeed.initialize(model=model, config=config, mpu=grid)
    dp, d, r = engine.dp_world_size, engine.get_data_parallel_rank(), grid.get_sequence_parallel_rank()
    # This rank's loader holds its data replica's batches for steps r, r + SP, ...: the adapter hands the
    # sequence group step i's batch (drawn by peer i % SP) at iteration i.
    mine = [_batch(s, MB * dp)[d * MB:(d + 1) * MB] for s in range(r, STEPS, SP)]
    dl = [{"input_ids": x, "labels": x, "position_ids": torch.arange(SEQ).expand(MB, SEQ)} for x in mine]
    loader = UlyssesSPDataLoaderAdapter(dl, r, engine.seq_parallel_group, SP, "cpu")
    losses, norms = [], []
    for _ in range(STEPS):
        b = next(loader)
        logits = engine(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
        local = model.loss_function(logits=logits, labels=None, shift_labels=b["shift_labels"], vocab_size=VOCAB)
        loss = sequence_mean_loss(local, (b["shift_labels"] != -100).sum(), engine.seq_parallel_group)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        comm.all_reduce(mean)
        losses.append(mean.item() / comm.get_world_size())
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "dp": dp}


def _check(results: list[dict], ref: tuple[list[float], list[float]], dp: int) -> None:
    for r in results:
        assert r["dp"] == dp
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref[1]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_llama_gqa_ulysses_matches_one_process(stage: int, world: int) -> None:
    dp = world // SP
    _check(run_distributed(_train, world, stage, timeout=240), _reference(dp), dp)


@pytest.mark.parametrize("arch,kv_heads", [("qwen2", 2), ("mistral", 1), ("gpt2", 4)])
def test_other_architectures_match_one_process(arch: str, kv_heads: int) -> None:
    # mistral with one key/value head: repeated so each of the two ranks attends over one
    _check(run_distributed(_train, 2, 2, arch, kv_heads, True, timeout=240), _reference(1, arch, kv_heads), 1)
