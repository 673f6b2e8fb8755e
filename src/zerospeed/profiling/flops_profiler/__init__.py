"""Flops profiler: per-module params, MACs, FLOPs and forward latency, plus MFU where the peak is known."""

from __future__ import annotations

from .counter import FlopCounter, ModuleStats
from .peaks import PEAK_FLOPS, mfu, peak_flops
from .profiler import FlopsProfiler, get_model_profile
from .rules import attention_counts, count_call
from .units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "PEAK_FLOPS",
    "FlopCounter",
    "FlopsProfiler",
    "ModuleStats",
    "attention_counts",
    "count_call",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "mfu",
    "number_to_string",
    "params_to_string",
    "peak_flops",
]
