"""Config sections for observability: flops profiler, monitors, comms logger, activation checkpointing."""

from __future__ import annotations

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
