"""``deepspeed.runtime.utils.see_memory_usage`` (the inference text-generation example calls it) and
``call_to_str`` (the pipeline instructions' text)."""

from __future__ import annotations

from ..parallel.pipeline.schedule import call_to_str
from ..profiling.memory import see_memory_usage

__all__ = ["call_to_str", "see_memory_usage"]
