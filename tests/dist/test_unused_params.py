"""Unused parameters cost nothing: learned on the first step, they no longer hold back their bucket (and
every bucket after it), so buckets launch during backward and stage 2 keeps about two bucket buffers plus
the partition. ``zero_optimization.ignore_unused_parameters: false`` raises as in DeepSpeed (stages 1-2)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import make_model, micro_batch, param_groups

MB, LAYERS = 2, 8


class Deep(torch.nn.Module):
    """Eight equal layers (one bucket each) and an unused layer registered last: buckets follow the reverse
    of ``parameters()`` order, so the unused parameters sit in bucket 0, the first to be launched."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(LAYERS))
        self.head = torch.nn.Linear(8, 4)
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(self.head(x), y)


def _engine(stage: int, zero: dict[str, Any] | None = None, deep: bool = False) -> Any:
    import zerospeed

    model = Deep() if deep else make_model()  # TinyNet: ``unused`` sits in bucket 0 too
    params = model.parameters() if deep else param_groups(model)
    config = {"train_micro_batch_size_per_gpu": MB, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 72 if deep else 40, **(zero or {})},
              "steps_per_print": 1000, "gradient_clipping": 0.0}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=params, config=config)
    return engine


def _probe(stage: int) -> dict[str, Any]:
    from zerospeed import comm

    engine = _engine(stage, deep=True)
    reducer = engine.optimizer.reducer
    seen: dict[str, Any] = {"bytes": 0, "launched": 0}

    def watch(p: torch.Tensor) -> None:  # runs after the reducer's own hook for the same gradient
        seen["bytes"] = max(seen["bytes"], reducer.grad_bytes())
        seen["launched"] = max(seen["launched"], reducer.tracker.next_launch)

    for p in engine.module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(watch)
    rank, world = comm.get_rank(), comm.get_world_size()
    for step in range(3):
        if step == 1:  # measure after the first step (where unused parameters are learned)
            seen.update(bytes=0, launched=0)
        x, y = micro_batch(step, 0, rank, world, MB, 1)
        engine.backward(engine(x, y))
        engine.step()
    partition = sum(reducer.partition_buffer(g).numel() * 4 for g in range(len(reducer.groups)))
    bucket = max(b.shard_numel * grp.num_partitions * 4 for grp in reducer.groups for b in grp.plan.buckets)
    buckets = sum(len(grp.plan.buckets) for grp in reducer.groups)
    return {**seen, "partition": partition, "bucket": bucket, "buckets": buckets}


@pytest.mark.parametrize("stage", [0, 2])
def test_unused_parameter_does_not_hold_back_later_buckets(stage: int) -> None:
    for r in run_distributed(_probe, 2, stage, timeout=60):
        assert r["buckets"] >= LAYERS, r
        assert r["launched"] >= r["buckets"] // 2, f"buckets wait for the end of backward: {r}"
        if stage == 2:  # transient bucket buffers: about two in flight, not the whole model
            assert r["bytes"] <= r["partition"] + 3 * r["bucket"], r


def _late_term(model: Any, step: int, rank: int) -> torch.Tensor | float:
    """The parameter unused in the first steps takes part from step 2 on rank 1, from step 3 on every rank."""
    if step >= 3 or (step == 2 and rank == 1):
        return (model.unused ** 2).sum()
    return 0.0


def _late_reference(world: int) -> list[float]:
    from .parity import global_batch

    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    losses = []
    for step in range(5):
        x, y = global_batch(step, MB * world)
        loss = model(x, y) + sum(_late_term(model, step, r) for r in range(world)) / world
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        losses.append(loss.item())
    return losses


def _late_use(stage: int) -> list[float]:
    from zerospeed import comm

    engine = _engine(stage)
    rank, world = comm.get_rank(), comm.get_world_size()
    losses = []
    for step in range(5):
        x, y = micro_batch(step, 0, rank, world, MB, 1)
        loss = engine(x, y) + _late_term(engine.module, step, rank)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        comm.all_reduce(total)
        losses.append(float(total) / world)
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameter_used_after_being_unused_gets_its_gradient(stage: int) -> None:
    """Its gradient arrives after its bucket left: it is reduced at the step, on every rank, and counted."""
    ref = _late_reference(2)
    for losses in run_distributed(_late_use, 2, stage, timeout=60):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)


def _strict(stage: int, ignore: bool) -> str:
    from zerospeed import comm

    engine = _engine(stage, {"ignore_unused_parameters": ignore})
    x, y = micro_batch(0, 0, comm.get_rank(), comm.get_world_size(), MB, 1)
    try:
        engine.backward(engine(x, y))
        engine.step()
    except RuntimeError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("stage", [1, 2])
def test_ignore_unused_parameters_false_raises(stage: int) -> None:
    for message in run_distributed(_strict, 2, stage, False, timeout=60):
        assert "got no gradient" in message and "unused" in message and "ignore_unused_parameters" in message
    assert run_distributed(_strict, 2, stage, True, timeout=60) == ["", ""]
