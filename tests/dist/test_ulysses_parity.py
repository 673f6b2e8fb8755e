"""Ulysses sequence parallelism trains like one process: zerospeed's GPT at sp=2 (world 2) and sp=2 x dp=2
(world 4) under ZeRO 1, 2 and 3 gives the unsharded run's losses and gradient norms (fp32, rtol 1e-5)."""

from __future__ import annotations

import pytest
import torch

import zerospeed
from zerospeed import comm
from zerospeed.models.gpt import GPT, GPTConfig
from zerospeed.parallel.sequence.gpt import sequence_parallel_gpt
from zerospeed.testing import run_distributed

STEPS, MB, SEQ, LR, CLIP = 10, 2, 8, 1e-2, 1.0
CFG = GPTConfig(vocab_size=32, block_size=SEQ, n_layer=2, n_head=4, n_embd=16)


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, CFG.vocab_size, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _reference(dp: int) -> tuple[list[float], list[float]]:
    model = GPT(CFG, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step, MB * dp)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(loss.item())
    return losses, norms


def _train(stage: int, sp: int) -> dict:
    model = GPT(CFG, seed=3)
    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
              "sequence_parallel_size": sp, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    sequence_parallel_gpt(model, engine.seq_parallel_group)
    dp, d = engine.dp_world_size, engine.get_data_parallel_rank()
    r = comm.get_rank(engine.seq_parallel_group)
    chunk = SEQ // sp
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step, MB * dp)
        rows, cols = slice(d * MB, (d + 1) * MB), slice(r * chunk, (r + 1) * chunk)
        pos = torch.arange(r * chunk, (r + 1) * chunk)
        _, loss = engine(x[rows, cols], y[rows, cols], position_ids=pos)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        comm.all_reduce(mean)  # every rank's shard holds the same number of tokens
        losses.append(mean.item() / comm.get_world_size())
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "dp": dp, "train_batch": engine.train_batch_size(),
            "sp_size": comm.get_world_size(engine.seq_parallel_group)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gpt_ulysses_matches_one_process(stage: int, world: int) -> None:
    dp = world // 2
    ref_losses, ref_norms = _reference(dp)
    for r in run_distributed(_train, world, stage, 2, timeout=180):
        assert (r["dp"], r["train_batch"], r["sp_size"]) == (dp, MB * dp, 2)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
