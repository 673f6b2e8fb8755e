"""The gradient reducer on one process (no process group): which gradients it takes, and when."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.zero import GradReducer, ReduceSettings, ShardedGroup


def _reducer(stage: int) -> tuple[nn.Module, GradReducer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    extra = nn.Linear(2, 2)  # never used in forward
    params = [*model.parameters(), *extra.parameters()]
    group = ShardedGroup(params, {}, 1, 0, bucket_numel=10, compute_dtype=torch.float32)
    settings = ReduceSettings(stage=stage, dp_size=1, accum_dtype=torch.float32, comm_dtype=torch.float32)
    return model, GradReducer([group], settings, None)


def _backward(model: nn.Module) -> None:
    model(torch.ones(1, 3)).sum().backward()


def test_gradients_outside_the_engines_backward_stay_in_p_grad() -> None:
    model, reducer = _reducer(2)
    _backward(model)  # not between begin/end_micro_step: someone else's backward
    assert all(p.grad is not None for p in model.parameters())
    assert not reducer.store.full[0].any()  # nothing taken into the buckets
    reducer.begin_micro_step(True)
    _backward(model)  # our own: taken (p.grad + the new gradient, as autograd accumulates)
    reducer.end_micro_step()
    assert all(p.grad is None for p in model.parameters())


def test_stage3_refuses_gradients_from_elsewhere() -> None:
    model, reducer = _reducer(3)
    with pytest.raises(RuntimeError, match="outside this engine's backward"):
        _backward(model)


def test_unused_parameters_are_learned_on_the_first_backward() -> None:
    model, reducer = _reducer(0)
    before = list(reducer.tracker.expected)
    reducer.begin_micro_step(True)
    _backward(model)
    reducer.end_micro_step()
    assert reducer.tracker.unused is not None and len(reducer.tracker.unused) == 2  # extra.weight, extra.bias
    assert sum(before) - sum(reducer.tracker.expected) == 2


def test_reset_forgets_the_step() -> None:
    model, reducer = _reducer(0)
    reducer.begin_micro_step(False)
    _backward(model)
    reducer.end_micro_step()
    assert reducer.store.full[0].abs().sum() > 0
    reducer.reset()
    assert reducer.store.full[0].abs().sum() == 0 and not reducer.pending and reducer.tracker.next_launch == 0
