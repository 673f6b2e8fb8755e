"""What the rest of zerospeed may ask of a device."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class Accelerator(ABC):
    name: str
    communication_backend: str

    @abstractmethod
    def device(self, local_rank: int | None = None) -> torch.device: ...

    @abstractmethod
    def set_device(self, local_rank: int) -> None: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def memory_allocated(self) -> int: ...

    @abstractmethod
    def max_memory_allocated(self) -> int: ...

    @abstractmethod
    def reset_peak_memory_stats(self) -> None: ...

    @abstractmethod
    def get_rng_state(self) -> torch.Tensor | None: ...

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor | None) -> None: ...

    @abstractmethod
    def is_bf16_supported(self) -> bool: ...

    def pin_memory(self, t: torch.Tensor) -> torch.Tensor:
        return t

    # --- copies to the host off the compute stream (offload) ----------------------------------------
    def side_stream(self) -> Any:
        """A stream for copies that overlap compute, or None where copies are synchronous (CPU)."""
        return None

    def copy_to_host(self, src: torch.Tensor, pin: bool, stream: Any) -> tuple[torch.Tensor, Any]:
        """Start copying device tensor ``src`` into a new host tensor (pinned if asked and possible) on
        ``stream``; returns ``(host, done)``: ``done.synchronize()`` waits for the copy. CPU: a plain copy."""
        return src.to("cpu", copy=True), _Ready()


class _Ready:
    def synchronize(self) -> None:
        return None
