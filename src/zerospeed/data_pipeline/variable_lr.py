"""Learning-rate scaling for dynamic batching (DeepSpeed's ``scale_lr`` and ``VariableBatchSizeLR``).

A batch of ``b`` samples where the base LR was set for ``B`` trains at ``lr * b / B`` ("linear", Goyal et
al.), ``lr * sqrt(b / B)`` ("sqrt", Krizhevsky) or ``lr`` ("none"). ``VariableBatchSizeLR`` wraps the
schedule the LR comes from (or a constant one over the optimizer's LRs): at each ``step`` it puts the
unscaled LRs back, steps the wrapped schedule, and scales its new LRs by the next batch's size, read from
the precomputed ``batch_sizes`` (cycled). ``step(0)`` at construction sets batch 0's LR. As in DeepSpeed,
``get_last_lr()`` answers the wrapped schedule's (unscaled) LRs and ``get_lr()`` the optimizer's (scaled).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from typing import Any

from torch.optim.lr_scheduler import LRScheduler

_log = logging.getLogger("zerospeed.data_pipeline")


def scale_lr(base_batch_size: int, batch_size: int, base_lr: float = 1, method: str | None = "linear") -> float:
    """The LR for ``batch_size`` samples when ``base_lr`` is right for ``base_batch_size``."""
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    if method is None or method.upper() == "NONE":
        return base_lr
    raise ValueError(f"Unknown scaling method: {method} (expected 'linear', 'sqrt' or 'none')")


class ConstantLR:
    """The schedule under ``VariableBatchSizeLR`` when there is only an optimizer: its LRs, unchanged. Any
    object with ``param_groups`` will do (zerospeed's ZeRO optimizer is one)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.last_epoch = 0
        self._last_lr = list(self.base_lrs)

    def get_lr(self) -> list[float]:
        return list(self.base_lrs)

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def step(self, epoch: int | None = None) -> None:
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        for group, lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = lr
        self._last_lr = list(self.base_lrs)

    def state_dict(self) -> dict[str, Any]:
        return {"base_lrs": list(self.base_lrs), "last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base_lrs, self.last_epoch = list(state["base_lrs"]), int(state["last_epoch"])
        self._last_lr = list(self.base_lrs)


class VariableBatchSizeLR(LRScheduler):
    """Scales a schedule's LRs by each batch's sample count (module docstring). ``LRScheduler`` is a base
    for ``isinstance`` checks only: the wrapped schedule owns the optimizer's state."""

    def __init__(self, lr_scheduler: Any, base_batch_size: int, batch_sizes: Sequence[int], dataloader: Any,
                 lr_scaling_method: str = "linear", last_epoch: int = -1, verbose: bool = False) -> None:
        if not batch_sizes:
            raise ValueError("VariableBatchSizeLR needs the batch sizes of at least one batch")
        self.base_lr_scheduler = lr_scheduler
        self.base_batch_size, self.batch_sizes = base_batch_size, list(batch_sizes)
        self.lr_scaling_method, self.dataloader = lr_scaling_method, dataloader
        self.last_epoch, self.verbose = last_epoch, verbose
        with warnings.catch_warnings():  # torch warns when get_lr() is called outside step(); we mean it
            warnings.simplefilter("ignore", UserWarning)
            self.base_lrs = list(lr_scheduler.get_lr())
        self.step(0)

    @property  # type: ignore[override]
    def optimizer(self) -> Any:
        return self.base_lr_scheduler.optimizer

    def get_last_lr(self) -> list[float]:
        return list(self.base_lr_scheduler.get_last_lr())

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:  # type: ignore[override]
        """Unscaled LRs back, the wrapped schedule stepped (``epoch`` passed on), then the next batch's scale."""
        unscaled = self.base_lrs if epoch == 0 else self.get_last_lr()
        for group, lr in zip(self.optimizer.param_groups, unscaled):
            group["lr"] = lr
        with warnings.catch_warnings():  # torch deprecates step(epoch); DeepSpeed passes it on all the same
            warnings.simplefilter("ignore", UserWarning)
            self.base_lr_scheduler.step(epoch)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        size = self.batch_sizes[self.last_epoch % len(self.batch_sizes)]
        for group in self.optimizer.param_groups:
            group["lr"] = scale_lr(self.base_batch_size, size, group["lr"], self.lr_scaling_method)
        if self.verbose:
            _log.info("Next batch id %d. Reference batch_size %d and lr %s. Scaled batch_size %d and lr %s.",
                      self.last_epoch, self.base_batch_size, unscaled, size, self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        return {"base_lr_scheduler": self.base_lr_scheduler.state_dict(), "base_batch_size": self.base_batch_size,
                "lr_scaling_method": self.lr_scaling_method, "batch_sizes": list(self.batch_sizes),
                "base_lrs": list(self.base_lrs), "last_epoch": self.last_epoch, "verbose": self.verbose}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base_lr_scheduler.load_state_dict(state_dict["base_lr_scheduler"])
        self.base_batch_size, self.lr_scaling_method = state_dict["base_batch_size"], state_dict["lr_scaling_method"]
        self.batch_sizes, self.base_lrs = list(state_dict["batch_sizes"]), list(state_dict["base_lrs"])
        self.last_epoch, self.verbose = state_dict["last_epoch"], state_dict["verbose"]


def lr_scheduler_for_variable_batch_size(base_batch_size: int, batch_sizes: Sequence[int], dataloader: Any,
                                         lr_scheduler_or_optimizer: Any, lr_scaling_method: str = "linear",
                                         verbose: bool = False) -> VariableBatchSizeLR:
    """A ``VariableBatchSizeLR`` over a schedule (anything with ``.optimizer``: torch's, DeepSpeed's or
    zerospeed's) or over an optimizer's constant LRs."""
    if hasattr(lr_scheduler_or_optimizer, "param_groups"):
        base: Any = ConstantLR(lr_scheduler_or_optimizer)
    elif hasattr(getattr(lr_scheduler_or_optimizer, "optimizer", None), "param_groups"):
        base = lr_scheduler_or_optimizer
    else:
        raise ValueError(f"Unknown type for lr_scheduler_or_optimizer: {type(lr_scheduler_or_optimizer).__name__} "
                         "(expected an optimizer or an LR scheduler with .optimizer)")
    return VariableBatchSizeLR(base, base_batch_size, batch_sizes, dataloader, lr_scaling_method, verbose=verbose)
