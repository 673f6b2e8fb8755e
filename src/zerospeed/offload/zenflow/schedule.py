"""ZenFlow's schedule, pure: at which iterations it selects columns and applies the host update.

Iteration ``t`` (0-based) is one optimizer step. With ``W = full_warm_up_rounds``, ``I`` the select
interval in steps (0: never again) and ``U`` the update interval (DeepSpeed's rules):

- ``t < W``: warm-up, a full step of every element.
- select at ``t == W`` and at every ``t > W`` with ``t % I == 0``;
- host update at ``t`` when ``(t + 1 - W) % U == 0``, and also before every reselection
  (``(t + 1) % I == 0``), so no accumulated gradient outlives its selection.

``update_interval: auto`` (``AutoInterval``) replaces the first rule by DeepSpeed's test on the 2-D
weights: with ``u`` the steps since the last host update, ``k = topk_ratio``, per weight
``avg = (avg * (u - 1) + critical) / u / (10 k)`` and ``rest += (total - critical) / (10 (1 - k))``
(``total`` and ``critical``: ``sum |grad|`` over the weight and over its selected columns); the host update
runs when ``rest >= avg`` holds for at least ``int(auto_ratio * weights)`` of them. After it ``u`` and
``rest`` restart (``avg`` carries on, as in DeepSpeed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Schedule:
    warm_up: int
    select_interval: int
    update_interval: int  # 0: auto

    def in_warm_up(self, t: int) -> bool:
        return t < self.warm_up

    def selects(self, t: int) -> bool:
        if t < self.warm_up:
            return False
        return t == self.warm_up or (self.select_interval != 0 and t % self.select_interval == 0)

    def before_reselect(self, t: int) -> bool:
        return self.select_interval != 0 and (t + 1) % self.select_interval == 0

    def fixed_update(self, t: int) -> bool:
        return (t + 1 - self.warm_up) % self.update_interval == 0 or self.before_reselect(t)


@dataclass
class AutoInterval:
    """DeepSpeed's ``update_interval: auto`` rule, over the 2-D weights of every group."""

    topk_ratio: float
    auto_ratio: float
    steps: int = 0  # u: steps since the last host update, this one included
    avg_critical: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    non_critical: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    def observe(self, total: torch.Tensor, critical: torch.Tensor) -> bool:
        """Record one step's sums (one entry per weight); whether the host update is due now."""
        if self.avg_critical.numel() != total.numel():
            self.avg_critical = torch.zeros_like(total)
            self.non_critical = torch.zeros_like(total)
        self.steps += 1
        u, k = self.steps, self.topk_ratio
        self.avg_critical = (self.avg_critical * (u - 1) + critical) / u / (k * 10)
        self.non_critical = self.non_critical + (total - critical) / ((1 - k) * 10)
        due = int((self.non_critical >= self.avg_critical).sum())
        return due >= int(self.auto_ratio * total.numel())

    def restart(self) -> None:
        self.steps = 0
        self.non_critical = torch.zeros_like(self.non_critical)
