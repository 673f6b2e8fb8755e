"""Config sections for observability: flops profiler, monitors, comms logger, activation checkpointing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class FlopsProfilerConfig(Section):
    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = Field(1, ge=1)
    module_depth: int = -1
    top_modules: int = Field(1, ge=1)
    detailed: bool = True
    output_file: str | None = None


class TensorBoardConfig(Section):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CsvMonitorConfig(Section):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Section):
    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CometConfig(Section):
    """``comet``: metrics to a Comet experiment from rank 0 (optional extra ``zerospeed[comet]``); each metric
    at most once per ``samples_log_interval`` samples. ``online: false`` keeps an offline experiment (a zip
    to upload later). The other keys are handed to ``comet_ml.start`` (DeepSpeed's keys and defaults)."""

    enabled: bool = False
    samples_log_interval: int = Field(100, ge=1)
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: Literal["get", "create", "get_or_create"] | None = None


class ThroughputTimerConfig(Section):
    """``timers.throughput``: ``enabled`` false stops ``engine.tput_timer`` (its average stays ``-inf``, as
    DeepSpeed's); ``synchronized`` waits for the device before each reading of the clock."""

    enabled: bool = True
    synchronized: bool = True


class TimersConfig(Section):
    """``timers`` (DeepSpeed's ``utils/config.py``): only ``throughput`` exists."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class CommsLoggerConfig(Section):
    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = Field(default_factory=list)
    debug: bool = False


class ActivationCheckpointingConfig(Section):
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
