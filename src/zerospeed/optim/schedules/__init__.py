"""DeepSpeed's LR schedules (``scheduler.type``), one readable file each."""

from .base import LRSchedule
from .factory import SCHEDULER_NAMES, build_scheduler
from .one_cycle import OneCycle
from .range_test import LRRangeTest
from .warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "SCHEDULER_NAMES",
    "LRRangeTest",
    "LRSchedule",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]
