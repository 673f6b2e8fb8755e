"""OneCycle cycles momentum through the engine as DeepSpeed does: beta1 between cycle_max_mom and cycle_min_mom
(beta2 pinned to 0.99), then decayed by decay_mom_rate; the values are DeepSpeed 0.19's, traced by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import engine_losses, micro_batch, reference_losses

ONE_CYCLE = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2, "cycle_second_step_size": 2,
             "decay_step_size": 2, "decay_lr_rate": 0.5, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
             "decay_mom_rate": 0.02}
# (lr, beta1) used by optimizer steps 1..6. DeepSpeed: scale = x / r up, (x - 1) / (r - 1) down, x the position
# in the cycle of last_batch_iteration + 1, r = 2 / 4; after the cycle, with d = it - 4 + 1:
# lr = 0.01 / (1 + 0.5 d / 2), beta1 = 0.95 (1 + 0.02 d / 2). The constructor writes (cycle_min_lr, cycle_min_mom).
EXPECTED = [(0.01, 0.85), (0.055, 0.90), (0.1, 0.85), (0.055, 0.90), (0.01, 0.95), (0.008, 0.9595)]


def _engine_moms(stage: int, optimizer: str) -> list[tuple[float, float, float]]:
    import zerospeed
    from zerospeed import comm

    from .parity import make_model, param_groups

    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": optimizer, "params": {"lr": 1e-2}},
              "scheduler": {"type": "OneCycle", "params": ONE_CYCLE}, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    seen = []
    for step in range(len(EXPECTED)):
        lr, (beta1, beta2) = engine.get_lr()[0], engine.get_mom()[0]
        inner = engine.optimizer.optimizer.param_groups[1]["betas"]  # what the torch optimizer will use
        assert inner == (beta1, beta2)
        seen.append((lr, beta1, beta2))
        x, y = micro_batch(step, 0, rank, world, 2, 1)
        engine.backward(engine(x, y))
        engine.step()
    return seen


@pytest.mark.parametrize("optimizer", ["AdamW", "Lamb"])
def test_one_cycle_momentum_values_through_engine(optimizer: str) -> None:
    for seen in run_distributed(_engine_moms, 2, 2, optimizer, timeout=120):
        assert [s[0] for s in seen] == pytest.approx([e[0] for e in EXPECTED], rel=1e-12)
        assert [s[1] for s in seen] == pytest.approx([e[1] for e in EXPECTED], rel=1e-12)
        assert all(s[2] == 0.99 for s in seen)


def test_one_cycle_momentum_parity() -> None:
    """Training with cycled momentum under ZeRO 2 equals one process with the same schedule object."""
    sched: dict[str, Any] = {"type": "OneCycle", "params": ONE_CYCLE}
    ref, ref_state = reference_losses(6, 2, 2, 2, 0.5, scheduler=sched)
    for losses, state in run_distributed(engine_losses, 2, 2, 6, 2, 2, 0.5, 1e-2, {"scheduler": sched}, timeout=120):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)
