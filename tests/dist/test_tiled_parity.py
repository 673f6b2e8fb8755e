"""Tiled MLP + tiled logits/loss compose with ZeRO 1-3 and Ulysses: zerospeed's GPT with both tilings, at sp=2
(world 2) and at plain dp=2, trains like the untiled single-process run (fp32; a shard of 7 tokens cut into
3 MLP shards of 3, 3, 1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zerospeed
from zerospeed import comm
from zerospeed.models.gpt import GPT, GPTConfig
from zerospeed.parallel.sequence.gpt import sequence_parallel_gpt
from zerospeed.testing import run_distributed

STEPS, MB, SEQ, LR, CLIP = 4, 2, 14, 1e-2, 1.0
CFG = GPTConfig(vocab_size=32, block_size=SEQ, n_layer=2, n_head=4, n_embd=16)
TILED = dataclasses.replace(CFG, tiled_mlp_shards=3, tiled_loss_shards=2)


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, CFG.vocab_size, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _reference() -> tuple[list[float], list[float]]:
    model = GPT(CFG, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step, MB * 2)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def _train(stage: int, sp: int) -> dict:
    model = GPT(TILED, seed=3)
    config = {"train_micro_batch_size_per_gpu": MB * sp, "gradient_accumulation_steps": 1,
              "gradient_clipping": CLIP, "sequence_parallel_size": sp,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},  # really cut
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    if sp > 1:
        sequence_parallel_gpt(model, engine.seq_parallel_group)
    rank = comm.get_rank()
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step, MB * 2)
        if sp > 1:  # every rank: the whole batch, its half of the sequence
            cols = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
            _, loss = engine(x[:, cols], y[:, cols], position_ids=torch.arange(SEQ)[cols])
        else:  # every rank: half the batch, the whole sequence
            rows = slice(rank * MB, (rank + 1) * MB)
            _, loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        comm.all_reduce(mean)
        losses.append(mean.item() / comm.get_world_size())
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms}


@pytest.mark.parametrize("stage,sp", [(1, 2), (2, 2), (3, 2), (2, 1)])
def test_tiled_gpt_matches_one_process(stage: int, sp: int) -> None:
    ref_losses, ref_norms = _reference()
    for r in run_distributed(_train, 2, stage, sp, timeout=180):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
