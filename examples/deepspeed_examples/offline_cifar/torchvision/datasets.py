"""``CIFAR10`` without a download: ``ZS_OFFLINE_CIFAR_SIZE`` (default 2048 train / 512 test) synthetic 3x32x32
images in [0, 1] whose per-channel means depend on the label, generated from a fixed seed."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch


class CIFAR10(torch.utils.data.Dataset):
    classes = ["plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

    def __init__(self, root: str = "./data", train: bool = True, download: bool = False,
                 transform: Callable[[Any], Any] | None = None) -> None:
        n = int(os.environ.get("ZS_OFFLINE_CIFAR_SIZE", "2048"))
        n = n if train else max(n // 4, 10)
        g = torch.Generator().manual_seed(0 if train else 1)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        centers = torch.rand(10, 3, 1, 1, generator=torch.Generator().manual_seed(7))
        noise = 0.15 * torch.randn(n, 3, 32, 32, generator=g)
        self.images = (centers[self.labels] + noise).clamp(0, 1)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.images[i]
        return (self.transform(x) if self.transform else x), int(self.labels[i])
