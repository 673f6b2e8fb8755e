"""Weights & Biases monitor (optional dependency): ``wandb.log({name: value}, step=step)`` per event."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...config.monitoring import WandbConfig
from .base import Event, Monitor, check_event, import_optional


def import_wandb() -> Any:
    return import_optional("wandb", "wandb", "pip install wandb")


class WandbMonitor(Monitor):
    """Starts one run (project, group, entity=team) and logs each event at its step."""

    def __init__(self, config: WandbConfig) -> None:
        self.wandb = import_wandb()
        self.enabled = True
        self.run = self.wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: Sequence[Event]) -> None:
        for event in events:
            name, value, step = check_event(event)
            self.wandb.log({name: value}, step=step)

    def close(self) -> None:
        finish = getattr(self.run, "finish", None)
        if callable(finish):
            finish()
