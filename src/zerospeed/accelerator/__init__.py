"""Device abstraction: the one place that knows about CPU vs CUDA."""

from __future__ import annotations

from .base import Accelerator
from .cpu import CpuAccelerator
from .cuda import CudaAccelerator

_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """CUDA when a device is visible, else CPU (override with ZEROSPEED_ACCELERATOR=cpu|cuda)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        import os

        choice = os.environ.get("ZEROSPEED_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
        if choice == "cpu":
            _ACCELERATOR = CpuAccelerator()
        elif choice == "cuda" or (choice is None and CudaAccelerator.available()):
            _ACCELERATOR = CudaAccelerator()
        else:
            _ACCELERATOR = CpuAccelerator()
    return _ACCELERATOR


def can_pin_memory() -> bool:
    """Whether host memory can be page-locked (a CUDA host allocator exists), whichever accelerator is chosen."""
    import torch

    return torch.cuda.is_available()


def set_accelerator(acc: Accelerator | None) -> None:
    global _ACCELERATOR
    _ACCELERATOR = acc


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's check that the selected accelerator is one this library drives (cpu and cuda here)."""
    return get_accelerator().name in ("cpu", "cuda")


__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "can_pin_memory", "get_accelerator",
           "is_current_accelerator_supported", "set_accelerator"]
