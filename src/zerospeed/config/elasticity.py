"""The ``elasticity`` section (DeepSpeed's keys and defaults) and the elasticity errors.

With ``enabled: true`` the global batch size is no longer set directly: ``zerospeed.elasticity`` picks one
that is at most ``max_train_batch_size``, splits into one of ``micro_batch_sizes`` on as many data-parallel
sizes in ``[min_gpus, max_gpus]`` as possible, and the engine derives micro batch and accumulation steps
for the size it runs at. DeepSpeed's path ``deepspeed.elasticity.config`` is served from here.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictInt, field_validator, model_validator

from .base import Section
from .errors import ConfigError

LATEST_ELASTICITY_VERSION = 0.2
MINIMUM_DEEPSPEED_VERSION = "0.3.8"
DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"  # what a resource scheduler saw (JSON)


class ElasticityError(ValueError):
    """Base of every elasticity error (DeepSpeed's class, here also a ``ValueError``)."""


class ElasticityConfigError(ElasticityError, ConfigError):
    """The ``elasticity`` section is missing, off, or holds a bad value; names the key."""

    def __init__(self, message: str, key: str = "elasticity") -> None:
        ConfigError.__init__(self, key, message)


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one of the sizes the elastic batch size divides into."""


class ElasticityConfig(Section):
    """DeepSpeed's ``elasticity`` keys. ``max_train_batch_size`` and ``micro_batch_sizes`` are required
    when enabled (DeepSpeed's 2000 and [2, 4, 6] apply only to a disabled section)."""

    enabled: bool = False
    max_train_batch_size: int | None = Field(None, ge=1)
    """Largest acceptable global batch size (required when enabled)."""
    micro_batch_sizes: list[StrictInt] | None = None
    """Acceptable ``train_micro_batch_size_per_gpu`` values, positive integers (required when enabled)."""
    min_gpus: int = Field(1, ge=1)
    max_gpus: int = Field(10000, ge=1)
    min_time: float = Field(0, ge=0)
    """Minutes a scheduler should let the job run before rescaling it (read by schedulers, not the engine)."""
    version: float | str = LATEST_ELASTICITY_VERSION
    """0.1: world sizes are GPU counts; 0.2: node counts times data-parallel ranks per node."""
    prefer_larger_batch: bool = True
    """Among batch sizes valid for equally many world sizes, take the largest (else the smallest)."""
    ignore_non_elastic_batch_info: bool = False
    """Allow (and ignore) ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` /
    ``gradient_accumulation_steps`` beside an enabled section; otherwise they are an error."""
    model_parallel_size: int = Field(1, ge=1)
    """Version 0.2 only: ranks per model replica; ``num_gpus_per_node`` must be a multiple of it."""
    num_gpus_per_node: int = Field(1, ge=1)

    @field_validator("micro_batch_sizes")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and not all(m > 0 for m in v):
            raise ValueError(f"must hold positive integers, got {v}")
        return v

    @field_validator("version")
    @classmethod
    def _number(cls, v: Any) -> Any:
        try:
            float(v)
        except (TypeError, ValueError):
            raise ValueError(f"must be a version number such as 0.1 or 0.2, got {v!r}") from None
        return v

    @model_validator(mode="after")
    def _required_when_enabled(self) -> ElasticityConfig:
        if self.enabled:
            for key in ("max_train_batch_size", "micro_batch_sizes"):
                if getattr(self, key) is None:
                    raise ValueError(f"Elasticity config missing {key}")
        if self.max_gpus < self.min_gpus:
            raise ValueError(f"Elasticity min_gpus cannot be greater than max_gpus, given min_gpus: "
                             f"{self.min_gpus}, max_gpus: {self.max_gpus}")
        return self

    @property
    def version_number(self) -> float:
        return float(self.version)


def parse_elasticity(section: Any) -> ElasticityConfig:
    """Validate a raw ``elasticity`` dict; a bad value is an ``ElasticityConfigError`` naming its key."""
    try:
        return ElasticityConfig.parse_section(section, "elasticity")
    except ConfigError as exc:
        if isinstance(exc, ElasticityConfigError):
            raise
        raise ElasticityConfigError(str(exc).split(": ", 1)[-1], exc.key) from None
