"""``deepspeed.runtime.utils.see_memory_usage`` (the inference text-generation example calls it)."""

from __future__ import annotations

from ..profiling.memory import see_memory_usage

__all__ = ["see_memory_usage"]
