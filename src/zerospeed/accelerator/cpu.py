"""CPU: gloo, host memory measured by the process (RSS)."""

from __future__ import annotations

import os
import resource

import psutil
import torch

from .base import Accelerator


class CpuAccelerator(Accelerator):
    name = "cpu"
    communication_backend = "gloo"

    def device_count(self) -> int:
        """``LOCAL_SIZE`` (the ranks on this node, set by the launcher) as DeepSpeed's CPU accelerator, else 1."""
        return int(os.environ.get("LOCAL_SIZE", "1"))

    def device_name(self, device_index: int | None = None) -> str:
        """``"cpu"`` whatever the index: the host is one device (DeepSpeed's CPU accelerator answers the same)."""
        return "cpu"

    def device(self, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def memory_allocated(self) -> int:
        return int(psutil.Process().memory_info().rss)

    def max_memory_allocated(self) -> int:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def reset_peak_memory_stats(self) -> None:
        return None

    def get_rng_state(self) -> torch.Tensor | None:
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        return None

    def is_bf16_supported(self) -> bool:
        return True
