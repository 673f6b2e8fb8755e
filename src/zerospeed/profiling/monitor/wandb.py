"""Weights & Biases monitor (optional dependency): ``wandb.log({name: value}, step=step)`` per event."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...config.monitoring import WandbConfig
from .base import Event, Monitor, check_event, import_optional, writes_here


def import_wandb() -> Any:
    return import_optional("wandb", "wandb", "pip install wandb")


class WandbMonitor(Monitor):
    """Starts one run (project, group, entity=team) and logs each event at its step. It keeps DeepSpeed's
    ``enabled`` / ``group`` / ``team`` / ``project``; a disabled one (or one off rank 0) imports and starts nothing."""

    def __init__(self, config: WandbConfig, rank: int | None = None) -> None:
        self.enabled = config.enabled
        self.group = config.group
        self.team = config.team
        self.project = config.project
        self.wandb: Any = None
        self.run: Any = None
        if writes_here(self.enabled, rank):
            self.wandb = import_wandb()
            self.run = self.wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: Sequence[Event]) -> None:
        if self.wandb is None:
            return
        for event in events:
            name, value, step = check_event(event)
            self.wandb.log({name: value}, step=step)

    def close(self) -> None:
        finish = getattr(self.run, "finish", None)
        if callable(finish):
            finish()
