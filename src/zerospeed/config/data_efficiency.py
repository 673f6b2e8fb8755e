"""DeepSpeed's data-efficiency sections: ``data_efficiency`` (curriculum sampling, random-LTD), the legacy
top-level ``curriculum_learning`` (sequence-length curriculum) and ``progressive_layer_drop``.

Keys, defaults and the per-schedule required keys are DeepSpeed's (``runtime/data_pipeline/constants.py``,
``curriculum_scheduler.py``, ``data_routing/scheduler.py``; PLD and the legacy curriculum from v0.19.5).
The code that uses them lives in ``zerospeed/data_pipeline/``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section

ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]


class CurriculumScheduleConfig(Section):
    """``schedule_config``: fixed_linear needs total_curriculum_step and difficulty_step, fixed_root also
    root_degree, fixed_discrete difficulty (one more entry than max_step) and max_step; custom none."""

    total_curriculum_step: int | None = Field(None, gt=0)
    difficulty_step: int | None = Field(None, gt=0)
    root_degree: float | None = Field(None, gt=0)
    difficulty: list[int | float] | None = None
    max_step: list[int] | None = None


class CurriculumScheduleSection(Section):
    """What one curriculum scheduler reads (DeepSpeed's ``CurriculumScheduler(config)``)."""

    min_difficulty: int | float
    max_difficulty: int | float
    schedule_type: ScheduleType
    schedule_config: CurriculumScheduleConfig = Field(default_factory=CurriculumScheduleConfig)

    @model_validator(mode="after")
    def _required_by_schedule(self) -> CurriculumScheduleSection:
        check_schedule(self)
        return self


def check_schedule(section: CurriculumScheduleSection) -> None:
    """DeepSpeed's constructor checks: the schedule_config keys each schedule type needs."""
    need = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
            "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
            "fixed_discrete": ("difficulty", "max_step"), "custom": ()}[section.schedule_type]
    sc = section.schedule_config
    for key in need:
        if getattr(sc, key) is None:
            raise ValueError(f"schedule_type {section.schedule_type!r} requires schedule_config.{key}")
    if section.schedule_type == "fixed_discrete":
        assert sc.difficulty is not None and sc.max_step is not None
        if not sc.max_step or len(sc.difficulty) != len(sc.max_step) + 1:
            raise ValueError("fixed_discrete: schedule_config.difficulty needs exactly one more entry than "
                             f"max_step (the last difficulty holds after the last max_step); got "
                             f"{len(sc.difficulty)} and {len(sc.max_step)}")


class LegacyCurriculumConfig(CurriculumScheduleSection):
    """Top-level ``curriculum_learning`` (DeepSpeed's legacy form, removed in 0.19.8): with
    ``curriculum_type: "seqlen"`` the engine passes ``curriculum_seqlen=<difficulty>`` to the model's forward."""

    enabled: bool = False
    curriculum_type: str = "seqlen"
    min_difficulty: int | float = 0
    max_difficulty: int | float = 0
    schedule_type: ScheduleType = "fixed_linear"

    @model_validator(mode="after")
    def _required_by_schedule(self) -> LegacyCurriculumConfig:
        if self.enabled:
            if not {"min_difficulty", "max_difficulty", "schedule_type"} <= self.model_fields_set:
                raise ValueError("curriculum learning requires min_difficulty, max_difficulty and schedule_type")
            check_schedule(self)
        return self


class CurriculumMetricConfig(CurriculumScheduleSection):
    """One entry of ``curriculum_metrics``: a difficulty schedule over one per-sample metric."""

    index_to_sample_path: str | None = None
    index_to_metric_path: str | None = None
    difficulty_type: Literal["value", "percentile"] = "value"
    clustering_type: Literal["single_cluster", "schedule_based"] = "schedule_based"


class SamplingCurriculumConfig(Section):
    """``data_efficiency.data_sampling.curriculum_learning``: the sampler draws each global batch only from
    samples whose metrics are within the current difficulties."""

    enabled: bool = False
    data_cluster_path: str | None = None
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _metrics_given(self) -> SamplingCurriculumConfig:
        if self.enabled and not self.curriculum_metrics:
            raise ValueError("curriculum learning is enabled, curriculum_metrics must be specified")
        return self


class DynamicBatchingConfig(Section):
    """``data_efficiency.data_sampling.dynamic_batching``: samples packed into micro-batches of at most
    ``max_tokens`` tokens, the learning rate scaled by each batch's sample count
    (``data_pipeline/variable_batch.py``; built by ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed``,
    as in DeepSpeed). Defaults are DeepSpeed's (``runtime/data_pipeline/constants.py``)."""

    enabled: bool = False
    max_tokens: int | None = Field(None, gt=0)
    """The most tokens (summed sequence lengths) in one micro-batch; required when enabled."""
    lr_scaling_method: Literal["linear", "sqrt", "none", "None", "NONE"] = "linear"
    min_batch_size: int = Field(1, ge=0)
    max_batch_size: int | None = Field(None, ge=0)
    sequence_picking_order: Literal["dataloader", "random", "seqlen"] = "dataloader"
    metrics_path: str | None = None
    """Where ``seqlen/seqlen_sample_to_metric`` (DeepSpeed's data-analyzer output) is read or written."""
    verbose: bool = False

    @model_validator(mode="after")
    def _max_tokens_given(self) -> DynamicBatchingConfig:
        if self.enabled and self.max_tokens is None:
            raise ValueError("dynamic batching is enabled, so max_tokens must be specified")
        return self


class DataSamplingConfig(Section):
    enabled: bool = False
    num_epochs: int = Field(1000, ge=1)
    num_workers: int = Field(0, ge=0)
    pin_memory: bool = False
    curriculum_learning: SamplingCurriculumConfig = Field(default_factory=SamplingCurriculumConfig)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)


class RandomLTDScheduleParams(Section):
    require_steps: int = Field(gt=0)
    """Steps over which the kept-token count grows from min_value to max_value."""
    seq_per_step: int = Field(gt=0)
    """The kept-token count is a multiple of this."""


class RandomLTDScheduleConfig(Section):
    min_value: int = Field(gt=0)
    max_value: int = Field(gt=0)
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    schedule_config: RandomLTDScheduleParams


class RandomLTDConfig(Section):
    """``data_efficiency.data_routing.random_ltd``: the layers listed by ``random_ltd_layer_id`` (wrapped in
    ``RandomLayerTokenDrop``) see only a random subset of the tokens, growing by the schedule."""

    enabled: bool = False
    total_layer_num: int | None = Field(None, ge=1)
    random_ltd_layer_num: int | None = Field(None, ge=1)
    random_ltd_layer_id: list[int] = Field(default_factory=list)
    model_mask_name: str | None = None
    model_type: Literal["decoder", "encoder"] = "decoder"
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    random_ltd_schedule: RandomLTDScheduleConfig | None = None

    @model_validator(mode="after")
    def _complete(self) -> RandomLTDConfig:
        if self.enabled:
            for key in ("total_layer_num", "random_ltd_layer_num", "random_ltd_schedule"):
                if getattr(self, key) is None:
                    raise ValueError(f"random_ltd is enabled, {key} must be specified")
        return self


class DataRoutingConfig(Section):
    enabled: bool = False
    random_ltd: RandomLTDConfig = Field(default_factory=RandomLTDConfig)


class DataEfficiencyConfig(Section):
    """``data_efficiency``. As in DeepSpeed, the inner ``enabled`` flags (curriculum_learning, random_ltd)
    switch the features on; the outer ones are read and a warning names any that is false beside an inner one
    that is true."""

    enabled: bool = False
    seed: int = 1234
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig)


class ProgressiveLayerDropConfig(Section):
    """``progressive_layer_drop``: keep probability theta(t) = (1 - theta) * exp(-gamma * t) + theta."""

    enabled: bool = False
    theta: float = Field(1.0, ge=0, le=1)
    gamma: float = Field(0.001, ge=0)
