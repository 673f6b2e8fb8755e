"""DeepSpeed's ``autotuning`` section (0.19.6's keys and defaults).

The engine reads ``enabled`` / ``start_profile_step`` / ``end_profile_step`` / ``metric_path`` /
``model_info_path`` / ``model_info`` when ``zerospeed autotune`` runs an experiment (it profiles those steps,
writes the metrics and ends the run); ``zerospeed.autotuning`` reads the rest to plan the experiments.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .base import Section


class ModelInfoConfig(Section):
    profile: bool = False
    """true: the experiment only measures the model (parameter count) and ends."""
    num_params: int | None = Field(None, ge=1)
    hidden_size: int | None = Field(None, ge=1)
    num_layers: int | None = Field(None, ge=1)


class AutotuningConfig(Section):
    enabled: bool = False
    fast: bool = True
    """true: tune the micro-batch size per ZeRO stage only; false: also each stage's tuning space."""
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    start_profile_step: int = Field(3, ge=0)
    end_profile_step: int = Field(5, ge=1)
    metric_path: str | None = None
    model_info_path: str | None = None
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: int = Field(5, ge=1)
    tuner_num_trials: int = Field(50, ge=1)
    arg_mappings: dict[str, str] | None = None
    max_train_batch_size: int | None = Field(None, ge=1)
    min_train_batch_size: int = Field(1, ge=1)
    max_train_micro_batch_size_per_gpu: int = Field(1024, ge=1)
    min_train_micro_batch_size_per_gpu: int = Field(1, ge=1)
    num_tuning_micro_batch_sizes: int = Field(3, ge=1)
    mp_size: int = Field(1, ge=1)
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    model_info: ModelInfoConfig = Field(default_factory=ModelInfoConfig)

    def model_post_init(self, _: Any) -> None:
        if self.enabled and self.end_profile_step <= self.start_profile_step:
            from .errors import ConfigError

            raise ConfigError("autotuning.end_profile_step", f"must be after start_profile_step "
                              f"({self.end_profile_step} <= {self.start_profile_step})")
