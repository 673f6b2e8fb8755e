"""Every config scheduler through the engine applies, at each optimizer step, the lr DeepSpeed applies.

The reference is plain PyTorch on one process with the same schedule object stepped after each
optimizer step (DeepSpeed's order), so a shift by one step would show up in the losses.
"""

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import engine_losses, reference_losses

SCHEDULES = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 4},
    "WarmupDecayLR": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 3,
                      "total_num_steps": 10, "warmup_type": "linear"},
    "WarmupCosineLR": {"total_num_steps": 10, "warmup_num_steps": 3, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01},
    "OneCycle": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.02, "cycle_first_step_size": 3,
                 "cycle_momentum": False},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 1.5},
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_scheduler_parity(name: str) -> None:
    sched = {"type": name, "params": SCHEDULES[name]}
    ref, _ = reference_losses(8, 2, 2, 2, 0.5, scheduler=sched)
    results = run_distributed(engine_losses, 2, 1, 8, 2, 2, 0.5, 1e-2, {"scheduler": sched}, timeout=120)
    for losses, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
