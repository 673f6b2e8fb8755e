"""``deepspeed.monitor.config``: DeepSpeed's monitor-config model over zerospeed's monitor sections.

``DeepSpeedMonitorConfig`` holds the four sections zerospeed's config already parses (``tensorboard``,
``wandb``, ``csv_monitor``, ``comet``, config/monitoring.py) under DeepSpeed's names; ``enabled`` is true
when any of them is, as in DeepSpeed. ``DeepSpeedConfig(...).monitor_config`` is one of these.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..config.base import Section
from ..config.monitoring import CometConfig, CsvMonitorConfig, TensorBoardConfig, WandbConfig

CSVConfig = CsvMonitorConfig  # DeepSpeed's class name


class DeepSpeedMonitorConfig(Section):
    """The monitor sections of a config, each with DeepSpeed's defaults when absent."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
    comet: CometConfig = Field(default_factory=CometConfig)

    @property
    def enabled(self) -> bool:
        return any(s.enabled for s in (self.tensorboard, self.wandb, self.csv_monitor, self.comet))


def get_monitor_config(param_dict: dict[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor sections of a raw config dict (DeepSpeed's helper)."""
    return DeepSpeedMonitorConfig(**{k: param_dict.get(k, {}) for k in ("tensorboard", "wandb", "csv_monitor", "comet")})


__all__ = ["CSVConfig", "CometConfig", "DeepSpeedMonitorConfig", "TensorBoardConfig", "WandbConfig",
           "get_monitor_config"]
