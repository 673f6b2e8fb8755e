"""Profiling: flops profiler, timers, memory reports and monitors (TensorBoard, CSV, W&B)."""

from __future__ import annotations

from .flops_profiler import FlopsProfiler, get_model_profile
from .memory import MemoryMeasurement, MemoryTracker, PeakMeter, measure_memory, see_memory_usage
from .monitor import Monitor, MonitorMaster, build_monitors
from .timers import Timer, Timers

__all__ = [
    "FlopsProfiler",
    "MemoryMeasurement",
    "MemoryTracker",
    "Monitor",
    "MonitorMaster",
    "PeakMeter",
    "Timer",
    "Timers",
    "build_monitors",
    "get_model_profile",
    "measure_memory",
    "see_memory_usage",
]
