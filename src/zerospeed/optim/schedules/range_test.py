"""LRRangeTest: grow the lr from ``lr_range_test_min_lr`` to find the largest lr that still trains.

``lr = min_lr * (1 + step_rate * k)`` with ``k = (i + 1) / step_size``, or ``floor`` of it in staircase mode
(``i = last_batch_iteration``; the constructor writes ``min_lr``), as DeepSpeed does.
"""

from __future__ import annotations

import math
from typing import Any

from ..validate import per_group
from .base import LRSchedule


class LRRangeTest(LRSchedule):
    """Linear (or staircase) lr growth; ``lr_range_test_min_lr`` may be a per-group list."""

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
    ) -> None:
        super().__init__(optimizer)
        if lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be positive, got {lr_range_test_step_size}")
        self.min_lrs = per_group(lr_range_test_min_lr, len(self.param_groups), "scheduler.params.lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        self._apply()

    def lrs_at(self, iteration: int) -> list[float]:
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        growth = 1.0 + self.step_rate * interval
        return [lr * growth for lr in self.min_lrs]
