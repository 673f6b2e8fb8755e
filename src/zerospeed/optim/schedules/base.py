"""What every LR schedule shares: the step counter, writing lrs into the optimizer, state_dict.

A schedule is a pure function of ``last_batch_iteration`` (``lrs_at``). DeepSpeed's contract: the
constructor writes the iteration ``-1`` lrs into the optimizer groups (the lr of the first optimizer step),
and the engine calls ``step()`` after each optimizer step that was taken (not after a skipped fp16 step),
which advances the counter and writes the lr of the next optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch


def param_groups_of(optimizer: Any) -> list[dict[str, Any]]:
    """The parameter groups of a torch optimizer or of a wrapper holding one in ``.optimizer``."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None and hasattr(optimizer, "optimizer"):
        groups = getattr(optimizer.optimizer, "param_groups", None)
    if groups is None:
        raise TypeError(f"{type(optimizer).__name__} has no param_groups: an LR schedule needs a torch optimizer")
    return groups


def write_lrs(groups: list[dict[str, Any]], lrs: list[float]) -> list[float]:
    """Set each group's lr; a tensor lr (fused/capturable optimizers) is written in place, so it stays the same
    tensor, with its dtype and shape, as in DeepSpeed."""
    for group, lr in zip(groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            with torch.no_grad():
                group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [float(lr) for lr in lrs]


class LRSchedule:
    """Base of the DeepSpeed schedules: subclasses define ``lrs_at(iteration)`` and call ``_apply()`` last."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.param_groups = param_groups_of(optimizer)
        self.last_batch_iteration = -1
        self._last_lr: list[float] = []

    def lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError(f"{type(self).__name__} must define lrs_at(iteration), the schedule's formula")

    def get_lr(self) -> list[float]:
        """The lrs for the current ``last_batch_iteration``."""
        return self.lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer (those of the next optimizer step)."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one optimizer step (or jump to ``last_batch_iteration``) and write the new lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def _apply(self) -> None:
        self._last_lr = write_lrs(self.param_groups, self.get_lr())

    def state_dict(self) -> dict[str, int]:
        """DeepSpeed's scheduler checkpoint: only the counter (every other value comes from the config)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counter and rewrite the optimizer's lrs for it (the same values as when saved)."""
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        self._apply()
