"""``zero_optimization`` section (stages 0-2 here)."""

from __future__ import annotations

from pydantic import Field, field_validator

from .base import Section

_AUTO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000}


class ZeroConfig(Section):
    """ZeRO: which model states are partitioned over the data-parallel ranks.

    stage 0: nothing (plain data parallelism); 1: optimizer state and fp32 master weights;
    2: also gradients.
    """

    stage: int = Field(0, ge=0, le=3)
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, gt=0)
    overlap_comm: bool | None = None
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    contiguous_gradients: bool = True
    round_robin_gradients: bool = False
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    ignore_unused_parameters: bool = True
    use_multi_rank_bucket_allreduce: bool = True
    sub_group_size: int = Field(1_000_000_000, gt=0)
    memory_efficient_linear: bool = True
    log_trace_cache_warnings: bool = False

    @field_validator("reduce_bucket_size", "allgather_bucket_size", mode="before")
    @classmethod
    def _auto(cls, v: object, info: object) -> object:
        if v == "auto":
            return _AUTO_DEFAULTS[info.field_name]  # type: ignore[attr-defined]
        return v
