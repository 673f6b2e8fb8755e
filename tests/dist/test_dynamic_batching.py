"""Dynamic batching in the engine (world 2, Gloo): the packed loader and the scaled LR of
``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed`` train like one process that packs the
same micro-batches (train_batch_size 4), averages their gradients and scales the LR by each batch's samples."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

MB, GAS, LR, MAX_TOKENS, STEPS = 1, 2, 0.2, 24, 4


def _dataset() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    g = torch.Generator().manual_seed(5)
    lengths = [int(n) for n in torch.randint(2, 13, (48,), generator=g)]
    return [(torch.randn(n, 4, generator=g), torch.randn(1, generator=g)) for n in lengths], lengths


def _collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    longest = max(len(x) for x, _ in samples)
    x = torch.zeros(len(samples), longest, 4)
    mask = torch.zeros(len(samples), longest)
    for i, (s, _) in enumerate(samples):
        x[i, :len(s)], mask[i, :len(s)] = s, 1.0
    return x, mask, torch.cat([y for _, y in samples])


class _Pooled(torch.nn.Module):
    """A masked mean over a variable-length sequence, then a regression loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) * mask[..., None]
        pooled = h.sum(1) / mask.sum(1, keepdim=True)
        return torch.nn.functional.mse_loss(self.out(pooled).squeeze(-1), y)


def _ranks() -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.data_pipeline import get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed

    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": 2},
              "data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": MAX_TOKENS}}}}
    data, lengths = _dataset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zerospeed.initialize(model=_Pooled(), config=config, training_data=data, collate_fn=_collate)
    loader, scheduler, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        data, engine, dataset_seqlens=lengths, dataloader_collate_fn=_collate)
    engine.lr_scheduler = scheduler  # the engine steps it at each boundary
    losses, lrs, batches = [], [], iter(loader)
    for _ in range(STEPS):
        lrs.append(engine.optimizer.param_groups[0]["lr"])
        total = torch.zeros(())
        for _ in range(GAS):
            loss = engine(*next(batches))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        comm.all_reduce(total)
        losses.append(float(total) / engine.train_batch_size())
    return {"losses": losses, "lrs": lrs, "weight": engine.module.out.weight.detach().clone(),
            "warned": any("get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed" in str(w.message)
                          for w in caught)}


def _reference() -> dict[str, Any]:
    from zerospeed.data_pipeline import batch_by_seqlens

    data, lengths = _dataset()
    microbatches, sizes, _ = batch_by_seqlens(lengths, MAX_TOKENS, effective_batch_size=4)
    model = _Pooled()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, lrs = [], []
    for step in range(STEPS):
        lr = LR * sizes[step] / 4
        lrs.append(lr)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        total = 0.0
        for _, ids in microbatches[4 * step:4 * step + 4]:
            loss = model(*_collate([data[i] for i in ids])) / 4
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return {"losses": losses, "lrs": lrs, "weight": model.out.weight.detach().clone(), "sizes": sizes[:STEPS]}


def test_dynamic_batching_at_world_two_equals_one_process() -> None:
    results = run_distributed(_ranks, 2, timeout=120)
    ref = _reference()
    assert len(set(ref["sizes"])) > 1  # the batches really vary, so the LR does too
    for got in results:
        assert got["warned"]  # initialize(training_data=...) builds fixed batches, and says where the packed ones are
        assert got["lrs"] == pytest.approx(ref["lrs"], rel=1e-12)
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        torch.testing.assert_close(got["weight"], ref["weight"], rtol=1e-5, atol=1e-6)
