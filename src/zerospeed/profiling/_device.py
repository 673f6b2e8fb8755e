"""Tiny device helpers for the profilers: synchronize and read device memory without an accelerator object.

The profilers only need two device facts: "wait for queued kernels" (so wall-clock timings are true) and
"how many bytes are allocated". Both are no-ops / zeros on CPU.
"""

from __future__ import annotations

import torch


def cuda_active() -> bool:
    """True when CUDA is usable *and* already initialized (never initializes CUDA as a side effect)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def synchronize() -> None:
    """Wait for all queued device work (CUDA); no-op on CPU."""
    if cuda_active():
        torch.cuda.synchronize()


def device_name() -> str:
    """Name of the current accelerator ('cpu' when none is active)."""
    if cuda_active():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return "cpu"
