"""OneCycle (1Cycle policy, https://arxiv.org/abs/1803.09820) with DeepSpeed's formulas and defaults.

One cycle of ``first + second`` steps: the lr climbs linearly from ``cycle_min_lr`` to ``cycle_max_lr`` over
``cycle_first_step_size`` steps and comes back over ``cycle_second_step_size``; momentum (Adam's beta1) moves
the opposite way between ``cycle_max_mom`` and ``cycle_min_mom``. Stair counts hold the values flat in that
many stairs per half. After the cycle, with ``d`` steps past it, ``lr = min_lr / (1 + decay_lr_rate * d /
decay_step_size)`` and ``beta1 = max_mom * (1 + decay_mom_rate * d / decay_step_size)``.

Faithful to DeepSpeed where it surprises: position ``i + 1`` is used (so the first ``step()`` already moves
one step up), the constructor writes ``cycle_min_lr`` and beta1 = ``cycle_min_mom`` while ``get_mom()`` before
the first ``step()`` reports the cycle's value at position 0 (``cycle_max_mom``), beta2 is set to 0.99
whenever momentum is cycled, and momentum cycling is turned off (with a warning) for optimizers without
``betas`` (e.g. SGD).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from ..validate import per_group
from .base import LRSchedule

PATH = "scheduler.params"

BETA2_WHEN_CYCLING = 0.99  # DeepSpeed pins beta2 to this value while it cycles beta1


class OneCycle(LRSchedule):
    """The 1Cycle lr (and beta1) schedule; ``get_mom()`` gives the betas it writes."""

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
    ) -> None:
        super().__init__(optimizer)
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = float(cycle_first_step_size if cycle_second_step_size is None
                                      else cycle_second_step_size)
        if self.first_step_size <= 0 or self.second_step_size < 0:  # a zero second half: the lr only climbs
            raise ValueError("cycle_first_step_size must be positive and cycle_second_step_size not negative")
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size  # DeepSpeed's attribute
        self.first_stair_count = int(cycle_first_stair_count)
        self.second_stair_count = int(
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = float(decay_step_size)
        n = len(self.param_groups)  # each of the four: one value, or one per parameter group
        self.min_lrs = per_group(cycle_min_lr, n, f"{PATH}.cycle_min_lr")
        self.max_lrs = per_group(cycle_max_lr, n, f"{PATH}.cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.min_moms = per_group(cycle_min_mom, n, f"{PATH}.cycle_min_mom")
        self.max_moms = per_group(cycle_max_mom, n, f"{PATH}.cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        no_decay = math.isclose(self.decay_step_size, 0.0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0.0)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0.0)
        self.cycle_momentum = bool(cycle_momentum) and self._has_betas()
        self._apply()

    def _has_betas(self) -> bool:
        inner = getattr(self.optimizer, "optimizer", None)
        defaults = getattr(self.optimizer, "defaults", None) or getattr(inner, "defaults", None) or {}
        if "betas" in defaults or all("betas" in g for g in self.param_groups):
            return True
        warnings.warn(
            f"OneCycle: cycle_momentum is turned off because {type(self.optimizer).__name__} has no 'betas' "
            "(as DeepSpeed does); only the lr is cycled",
            stacklevel=3,
        )
        return False

    def scale(self, iteration: int) -> float:
        """Height in the cycle, in [0, 1], for ``last_batch_iteration`` ``iteration`` (< total size)."""
        position = (iteration + 1) % self.total_size
        if position <= self.first_step_size:
            stairs, steps_from_bottom, half = self.first_stair_count, position, self.first_step_size
        else:
            stairs, steps_from_bottom, half = self.second_stair_count, self.total_size - position, self.second_step_size
        if stairs > 0:
            return math.floor(steps_from_bottom * stairs / half) / stairs
        return steps_from_bottom / half

    def _decay_steps(self, iteration: int) -> float:
        return (iteration - self.total_size + 1) / self.decay_step_size

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0 or (iteration >= self.total_size and self.skip_lr_decay):
            return list(self.min_lrs)
        if iteration < self.total_size:
            h = self.scale(iteration)
            return [lo + (hi - lo) * h for lo, hi in zip(self.min_lrs, self.max_lrs)]
        return [lo / (1.0 + self.decay_lr_rate * self._decay_steps(iteration)) for lo in self.min_lrs]

    def moms_at(self, iteration: int) -> list[tuple[float, float]]:
        """The (beta1, beta2) pairs written at ``iteration``."""
        if iteration < 0:
            beta1 = list(self.min_moms)
        elif iteration < self.total_size:
            h = self.scale(iteration)
            beta1 = [hi - (hi - lo) * h for lo, hi in zip(self.min_moms, self.max_moms)]
        elif self.skip_mom_decay:
            beta1 = list(self.max_moms)
        else:
            beta1 = [hi * (1.0 + self.decay_mom_rate * self._decay_steps(iteration)) for hi in self.max_moms]
        return [(b, BETA2_WHEN_CYCLING) for b in beta1]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < 0:  # DeepSpeed's formula at position 0, not what the constructor wrote
            return [(hi, BETA2_WHEN_CYCLING) for hi in self.max_moms]
        return self.moms_at(self.last_batch_iteration)

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            for group, betas in zip(self.param_groups, self.moms_at(self.last_batch_iteration)):
                group["betas"] = betas
