"""Monitors: TensorBoard, CSV and W&B sinks for ``(name, value, step)`` events, fanned out from rank 0."""

from __future__ import annotations

from ...config.monitoring import CsvMonitorConfig, TensorBoardConfig, WandbConfig
from .base import Event, Monitor, MonitorMaster
from .csv import CsvMonitor
from .tensorboard import TensorBoardMonitor
from .wandb import WandbMonitor

__all__ = [
    "CsvMonitor",
    "Event",
    "Monitor",
    "MonitorMaster",
    "TensorBoardMonitor",
    "WandbMonitor",
    "build_monitors",
]


def build_monitors(
    tensorboard: TensorBoardConfig | None = None,
    csv_monitor: CsvMonitorConfig | None = None,
    wandb: WandbConfig | None = None,
    rank: int = 0,
) -> MonitorMaster:
    """One fan-out monitor for the enabled sections; on ranks other than 0 it is disabled and writes nothing.

    A missing optional package (tensorboard, wandb) for an enabled section raises ``ConfigError`` naming
    ``<section>.enabled`` on rank 0.
    """
    if rank != 0:
        return MonitorMaster([])
    monitors: list[Monitor] = []
    if tensorboard is not None and tensorboard.enabled:
        monitors.append(TensorBoardMonitor(tensorboard))
    if csv_monitor is not None and csv_monitor.enabled:
        monitors.append(CsvMonitor(csv_monitor))
    if wandb is not None and wandb.enabled:
        monitors.append(WandbMonitor(wandb))
    return MonitorMaster(monitors)
