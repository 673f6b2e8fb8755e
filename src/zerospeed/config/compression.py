"""zerospeed only: ``gradient_compression``, sparsified gradient averaging (DeepSpeed has no such key and
ignores unknown top-level keys, so a config carrying it still runs under DeepSpeed, uncompressed)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class GradientCompressionConfig(Section):
    """``{"type": "topk", "ratio": 0.01}``: each rank sends only the ``ratio`` largest-magnitude entries of
    each gradient bucket (indices and values, all-gathered) instead of all-reducing it; with
    ``error_feedback`` the unsent rest is kept and added to the next step's gradient. ZeRO stages 0 and 1."""

    type: Literal["none", "topk"] = "none"
    ratio: float = Field(0.01, gt=0, le=1)
    error_feedback: bool = True
