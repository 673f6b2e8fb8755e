"""Optimizers and LR schedules addressable from the DeepSpeed config (``optimizer`` and ``scheduler``)."""

from .factory import OPTIMIZER_NAMES, build_optimizer
from .lamb import Lamb
from .schedules import (
    SCHEDULER_NAMES,
    LRRangeTest,
    LRSchedule,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "OPTIMIZER_NAMES",
    "SCHEDULER_NAMES",
    "LRRangeTest",
    "LRSchedule",
    "Lamb",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
]
