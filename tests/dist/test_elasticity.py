"""Elasticity in initialize(): the batch sizes come from the elastic config for the data-parallel size, so
the same global batch trains the same model at every valid world size (DeepSpeed's batch rules)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.elasticity import ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize
from zerospeed.testing import run_distributed

# Valid at 1-4 ranks with a global batch of 12: micro 4 x GAS 3, 3 x 2, 4 x 1, 3 x 1.
ELASTIC = {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [1, 2, 3, 4], "min_gpus": 1,
           "max_gpus": 4, "min_time": 20, "version": 0.1}
STEPS = 3


def _config(**top: object) -> dict:
    return {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "elasticity": dict(ELASTIC), **top}


def _train() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=_config())
    world, rank = engine.dp_world_size, engine.global_rank
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 4, generator=g), torch.randn(12, 1, generator=g)
        for k in range(gas):
            lo = (k * world + rank) * micro
            engine.backward(nn.functional.mse_loss(engine(x[lo:lo + micro]), y[lo:lo + micro]))
            engine.step()
    return {"sizes": (engine.train_batch_size(), micro, gas), "steps": engine.global_steps,
            "weight": model.weight.detach().clone()}


def test_same_global_batch_and_weights_at_every_world_size() -> None:
    runs = {w: run_distributed(_train, w) for w in (1, 2, 4)}
    assert runs[1][0]["sizes"] == (12, 4, 3)
    assert runs[2][0]["sizes"] == (12, 3, 2)
    assert runs[4][0]["sizes"] == (12, 3, 1)
    ref = runs[1][0]["weight"]
    for w in (2, 4):
        assert runs[w][0]["steps"] == STEPS
        torch.testing.assert_close(runs[w][0]["weight"], ref, rtol=1e-5, atol=1e-6)


def _initialize_errors() -> list[str]:
    model = nn.Linear(4, 1)
    seen = []
    for config, error in ((_config(train_batch_size=2), ElasticityConfigError),  # DeepSpeed's TestNonElasticBatchParams
                          ({**_config(), "elasticity": {**ELASTIC, "max_gpus": 1}}, ElasticityIncompatibleWorldSize)):
        with pytest.raises(error) as info:
            zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert isinstance(info.value, ElasticityError)
        seen.append(type(info.value).__name__)
    ignored = _config(train_batch_size=2)
    ignored["elasticity"]["ignore_non_elastic_batch_info"] = True  # ...WithOverride: the key is ignored
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=ignored)
    seen.append(str(engine.train_batch_size()))
    return seen


def test_initialize_errors_and_override() -> None:
    assert run_distributed(_initialize_errors, 2)[0] == ["ElasticityConfigError", "ElasticityIncompatibleWorldSize",
                                                         "12"]
