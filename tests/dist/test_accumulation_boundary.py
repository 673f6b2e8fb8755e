"""``set_gradient_accumulation_boundary`` overrides the engine's own micro-step count (world 2, SGD, fp32).

True on every micro-step of a ``gradient_accumulation_steps: 4`` run steps the optimizer every micro-step;
False on a ``gradient_accumulation_steps: 1`` run defers the step (gradients keep accumulating); ``None``
returns to counting. The weights are checked against plain SGD on the same gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed import comm
from zerospeed.testing import run_distributed

LR = 0.1


def _batch(micro: int, rank: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * micro + rank))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _grads(model: nn.Module, micros: list[int], world: int, gas: int) -> list[torch.Tensor]:
    """The engine's gradient over ``micros``: each micro-step's loss / gas, averaged over the ranks."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for m in micros:
        for r in range(world):
            grads = torch.autograd.grad(model(_batch(m, r)).pow(2).mean() / gas, list(model.parameters()))
            total = [t + g / world for t, g in zip(total, grads)]
    return total


def _sgd(model: nn.Module, grads: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.sub_(LR * g)


def _engine(stage: int, gas: int) -> tuple[Any, nn.Module]:
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage},
              "gradient_clipping": 0.0}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    return engine, model


def _micro(engine: Any, micro: int) -> None:
    engine.backward(engine(_batch(micro, comm.get_rank())).pow(2).mean())
    engine.step()


def _run(stage: int) -> dict[str, Any]:
    world = comm.get_world_size()
    out: dict[str, Any] = {}
    # gas 4, every micro-step declared a boundary: 3 optimizer steps, each on its own micro-batch
    engine, model = _engine(stage, 4)
    ref = _model()
    for m in range(3):
        engine.set_gradient_accumulation_boundary(True)
        assert engine.is_gradient_accumulation_boundary()
        _micro(engine, m)
        _sgd(ref, _grads(ref, [m], world, 4))
    out["forced_steps"] = engine.global_steps
    out["forced_match"] = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters()))
    # gas 1, boundary held off for two micro-steps, then counting again: one step on all three
    engine, model = _engine(stage, 1)
    ref = _model()
    before = [p.detach().clone() for p in model.parameters()]
    for m in range(2):
        engine.set_gradient_accumulation_boundary(False)
        _micro(engine, m)
    out["deferred_steps"] = engine.global_steps
    out["deferred_unchanged"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    engine.set_gradient_accumulation_boundary(None)
    _micro(engine, 2)
    _sgd(ref, _grads(ref, [0, 1, 2], world, 1))
    out["released_steps"] = engine.global_steps
    out["released_match"] = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters()))
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_boundary_override_is_honoured(stage: int) -> None:
    for out in run_distributed(_run, 2, stage, timeout=120):
        assert out == {"forced_steps": 3, "forced_match": True, "deferred_steps": 0, "deferred_unchanged": True,
                       "released_steps": 1, "released_match": True}
