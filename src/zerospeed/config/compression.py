"""zerospeed only: ``gradient_compression``, sparsified gradient averaging (DeepSpeed has no such key and
ignores unknown top-level keys, so a config carrying it still runs under DeepSpeed, uncompressed)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class GradientCompressionConfig(Section):
    """``{"type": "topk", "ratio": 0.01}``: each rank sends only the ``ratio`` largest-magnitude entries of
    each gradient bucket (indices and values, all-gathered) instead of all-reducing it; with
    ``error_feedback`` the unsent rest is kept and added to the next step's gradient. ZeRO stages 0 and 1.

    ``warmup_steps``: that many optimizer steps all-reduce densely before sparsification starts.
    ``freeze_variance`` (Adam / AdamW, needs ``warmup_steps`` > 0): from then on Adam's variance and its bias
    correction stay as they were at the end of the warm-up (``optim/frozen_variance.py``), so rare large
    accumulated values no longer inflate it. ``momentum_correction`` (needs ``freeze_variance``): DGC's, each
    rank exchanges top-k of its own accumulated momentum instead of its gradient. ``preconditioned_selection``
    (needs ``freeze_variance``): entries ranked by ``|x| / (sqrt(v) + eps)`` instead of ``|x|``.
    ``momentum_exchange`` (needs ``freeze_variance``, stage 0, no gradient clipping): 1-bit Adam's exchange with
    top-k, each rank sends the top-k of its error-compensated ``beta1 * m + (1 - beta1) * g`` and the average
    becomes Adam's momentum (``zero/topk_momentum.py``). ``union_indices`` (needs ``momentum_exchange``): the
    ranks all-gather their top-k indices and all-reduce their values at the union, so every sent entry is exact.
    ``local_variance`` (needs ``momentum_exchange``): each rank keeps Adam's variance live from its own local
    gradient and the ranks exchange the preconditioned momentum (the step) instead."""

    type: Literal["none", "topk"] = "none"
    ratio: float = Field(0.01, gt=0, le=1)
    error_feedback: bool = True
    warmup_steps: int = Field(0, ge=0)
    freeze_variance: bool = False
    momentum_correction: bool = False
    preconditioned_selection: bool = False
    momentum_exchange: bool = False
    union_indices: bool = False
    local_variance: bool = False
