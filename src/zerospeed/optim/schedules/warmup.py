"""Warmup schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, with DeepSpeed's formulas and defaults.

With ``n = max(2, warmup_num_steps)`` and ``i = last_batch_iteration``, the warmup fraction is
``log(i + 1) / log(n)`` ('log') or ``i / n`` ('linear') while ``i < n``, then 1. At construction (``i = -1``)
WarmupLR/WarmupDecayLR write ``warmup_min_lr`` and WarmupCosineLR writes 0, as DeepSpeed does.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from zerospeed.config.errors import ConfigError

from ..validate import per_group
from .base import LRSchedule

WARMUP_TYPES = ("log", "linear")
PATH = "scheduler.params"


def warmup_fraction(iteration: int, num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at ``iteration`` (``num_steps`` already >= 2); 1 after warmup."""
    if iteration >= num_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(num_steps)
    return iteration / num_steps


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ConfigError(f"{PATH}.warmup_num_steps", f"must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        raise ConfigError(f"{PATH}.warmup_type", f"must be 'log' or 'linear', got {warmup_type!r}")
    return max(2, warmup_num_steps)


class WarmupLR(LRSchedule):
    """Rise from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps, then stay there.

    ``warmup_max_lr`` defaults to the first group's lr (DeepSpeed's rule, applied to every group).
    Min and max may be per-group lists.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ) -> None:
        super().__init__(optimizer)
        n = len(self.param_groups)
        if warmup_max_lr is None:  # each group warms up to its own lr (DeepSpeed since 0.19.x)
            warmup_max_lr = [float(g["lr"]) for g in self.param_groups]
        self.min_lrs = per_group(warmup_min_lr, n, f"{PATH}.warmup_min_lr")
        self.max_lrs = per_group(warmup_max_lr, n, f"{PATH}.warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self._apply()

    def gamma(self, iteration: int) -> float:
        return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        g = self.gamma(iteration)
        return [lo + d * g for lo, d in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``: factor ``(T - i) / max(1, T - n)``.

    Unlike WarmupLR, ``warmup_max_lr`` defaults to 0.001 (DeepSpeed's default).
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(
                f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}", stacklevel=2
            )

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        remaining = float(self.total_num_steps - iteration)
        return max(0.0, remaining / float(max(1, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(LRSchedule):
    """Ratio of each group's lr: from ``warmup_min_ratio`` to 1 during warmup, then cosine to ``cos_min_ratio``.

    The base lrs are the optimizer groups' lrs at construction (``optimizer.params.lr``). After warmup the
    ratio is ``c + (1 - c) (1 + cos(pi p)) / 2`` with ``p = min(1, (i - n + 1) / max(1, T - n))``.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
    ) -> None:
        super().__init__(optimizer)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(
                f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}", stacklevel=2
            )
        self.org_lrs = [float(g["lr"]) for g in self.param_groups]
        self._apply()

    def lr_ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            frac = warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        progress = (iteration - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1.0 + math.cos(math.pi * min(1.0, progress))) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr_ratio(self) -> float:
        """DeepSpeed's name: the ratio at ``last_batch_iteration`` (0 before the first step)."""
        return self.lr_ratio(self.last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        ratio = self.lr_ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]
