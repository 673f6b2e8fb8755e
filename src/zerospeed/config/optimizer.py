"""``optimizer`` and ``scheduler`` sections: a type and its params (validated by zerospeed.optim)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .base import Section


class OptimizerConfig(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)
