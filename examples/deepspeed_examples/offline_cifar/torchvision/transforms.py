"""Compose, ToTensor and Normalize for the synthetic CIFAR images (already float tensors in [0, 1])."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class Compose:
    def __init__(self, steps: Sequence[Callable[[Any], Any]]) -> None:
        self.steps = list(steps)

    def __call__(self, x: Any) -> Any:
        for step in self.steps:
            x = step(x)
        return x


class ToTensor:
    def __call__(self, x: Any) -> torch.Tensor:
        return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float32)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std
