"""``deepspeed.runtime.zero.linear``: DeepSpeed's ZeRO-3 linear layer, which zerospeed does not need.

DeepSpeed's ``LinearModuleForZeroStage3`` exists so that autograd does not keep a gathered ZeRO-3 weight
alive between forward and backward. zerospeed's stage 3 frees a gathered weight after its module's forward
for every op, not only linear ones (``zero_optimization.memory_efficient_linear`` in config/hints.py), so the
layer is ``torch.nn.Linear`` under DeepSpeed's name and constructor, and autocast behaves as it does for
``nn.Linear``. ``autocast_custom_fwd`` / ``autocast_custom_bwd`` are DeepSpeed's decorators for custom
autograd functions: ``torch.amp.custom_fwd`` / ``custom_bwd`` bound to the accelerator's device type.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..accelerator import get_accelerator


def noop_decorator(func: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed's fallback decorator where torch has no ``custom_fwd`` (torch < 2.4): the function itself."""
    return func


_DEVICE = get_accelerator().device_name()
autocast_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=_DEVICE)
autocast_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=_DEVICE)


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSpeed's functional form: ``input @ weight.T + bias``."""
    return F.linear(input, weight, bias)


class LinearModuleForZeroStage3(torch.nn.Linear):
    """``y = x A^T + b`` with DeepSpeed's constructor ``(in_features, out_features, bias=True)``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)


__all__ = ["LinearModuleForZeroStage3", "autocast_custom_bwd", "autocast_custom_fwd", "noop_decorator",
           "zero3_linear_wrap"]
