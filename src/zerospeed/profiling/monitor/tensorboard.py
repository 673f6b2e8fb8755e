"""TensorBoard monitor: scalars through ``torch.utils.tensorboard.SummaryWriter`` in ``output_path/job_name``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ...config.errors import ConfigError
from ...config.monitoring import TensorBoardConfig
from .base import Event, Monitor, check_event, writes_here


class TensorBoardMonitor(Monitor):
    """Writes each event as ``add_scalar(name, value, step)`` and flushes after every batch of events. It keeps
    DeepSpeed's ``enabled`` / ``output_path`` / ``job_name``; a disabled one (or one off rank 0) opens no writer."""

    def __init__(self, config: TensorBoardConfig, rank: int | None = None) -> None:
        self.enabled = config.enabled
        self.output_path = config.output_path
        self.job_name = config.job_name
        self.log_dir = os.path.join(config.output_path, config.job_name)
        self.writer: Any = None
        if not writes_here(self.enabled, rank):
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard itself is missing
            raise ConfigError(
                "tensorboard.enabled",
                "is true but the 'tensorboard' package is not installed; `pip install tensorboard` "
                "or set tensorboard.enabled to false",
            ) from exc
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: Sequence[Event]) -> None:
        if self.writer is None:
            return
        for event in events:
            name, value, step = check_event(event)
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
