"""``prescale_gradients`` and ``gradient_predivide_factor`` scale *before* the reduction, and the result is the mean.

fp16 communicates gradients in fp16 (largest finite value 65504). Each of the 2 ranks holds gradients of
40000: summed as they are they overflow (the step is skipped), so a run that trains proves the values were
divided before the collective; SGD (the update is lr * gradient, no normalisation) then shows that the
reduced gradient is exactly the mean, 40000, so the division after the collective is right too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.testing import run_distributed

W0, X, LR = 1e-3, 20000.0, 1e-6


def _step(stage: int, extra: dict[str, Any]) -> dict[str, Any]:
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(W0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "fp16": {"enabled": True, "initial_scale_power": 0, "hysteresis": 1, "min_loss_scale": 0.5},
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        **extra,
    }
    engine, *_ = zerospeed.initialize(model=model, config=config)
    x = torch.full((2, 4), X, dtype=torch.float16)  # d(sum of outputs)/dw = 2 * X = 40000 on every rank
    engine.backward(engine(x).sum())
    engine.step()
    return {"skipped": engine.skipped_steps, "weight": model.weight.detach().float().clone()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_prescale_and_predivide_divide_before_reducing(stage: int) -> None:
    plain = run_distributed(_step, 2, stage, {}, timeout=120)
    assert all(r["skipped"] == 1 for r in plain), "the setup must overflow without scaling before the reduction"
    expected = torch.full((1, 4), W0 - LR * 2 * X).half().float()  # SGD on the mean gradient, 40000
    for extra in ({"gradient_predivide_factor": 2.0}, {"gradient_predivide_factor": 4.0},
                  {"prescale_gradients": True}):
        for r in run_distributed(_step, 2, stage, extra, timeout=120):
            assert r["skipped"] == 0, extra
            torch.testing.assert_close(r["weight"], expected, rtol=0, atol=0, msg=str(extra))
