"""DeepSpeed's ``deepspeed.runtime.utils.set_random_seed``: one seed for Python's, NumPy's and torch's PRNGs."""

from __future__ import annotations

import random

import torch

__all__ = ["set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seed ``random``, ``numpy.random`` (when NumPy is installed; it takes 32 bits) and torch (64 bits)."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))
