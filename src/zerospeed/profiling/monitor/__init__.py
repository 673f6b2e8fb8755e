"""Monitors: TensorBoard, CSV, W&B and Comet sinks for ``(name, value, step)`` events, fanned out from rank 0."""

from __future__ import annotations

from ...config.monitoring import CometConfig, CsvMonitorConfig, TensorBoardConfig, WandbConfig
from .base import Event, Monitor, MonitorMaster
from .comet import CometMonitor
from .csv import CsvMonitor
from .tensorboard import TensorBoardMonitor
from .wandb import WandbMonitor

__all__ = [
    "CometMonitor",
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
    comet: CometConfig | None = None,
) -> MonitorMaster:
    """One fan-out monitor for the enabled sections; on ranks other than 0 it is disabled and writes nothing.

    A missing optional package (tensorboard, wandb, comet_ml) for an enabled section raises ``ConfigError`` naming
    ``<section>.enabled`` on rank 0.
    """
    if rank != 0:
        return MonitorMaster([])
    monitors: list[Monitor] = []
    if tensorboard is not None and tensorboard.enabled:
        monitors.append(TensorBoardMonitor(tensorboard, rank))
    if csv_monitor is not None and csv_monitor.enabled:
        monitors.append(CsvMonitor(csv_monitor, rank))
    if wandb is not None and wandb.enabled:
        monitors.append(WandbMonitor(wandb, rank))
    if comet is not None and comet.enabled:
        monitors.append(CometMonitor(comet, rank))
    return MonitorMaster(monitors)
