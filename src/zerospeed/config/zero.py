"""``zero_optimization`` section (stages 0-3)."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import Field, field_validator, model_validator

from .base import Section
from .leaf_module import LeafModuleConfig
from .offload import OffloadOptimizerConfig, OffloadParamConfig
from .zenflow import ZenFlowConfig

_AUTO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
}


_log = logging.getLogger("zerospeed.config")

# DeepSpeed's deprecated booleans and the sections they stand for (``true`` means ``{"device": "cpu"}``).
_DEPRECATED_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


class ZeroConfig(Section):
    """ZeRO: which model states are partitioned over the data-parallel ranks.

    stage 0: nothing (plain data parallelism); 1: optimizer state and fp32 master weights;
    2: also gradients; 3: also the parameters themselves (gathered around each module's forward and
    backward). The ``stage3_*`` sizes count elements, as in DeepSpeed.
    """

    stage: int = Field(0, ge=0, le=3)
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, gt=0)
    overlap_comm: bool | None = None
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    contiguous_gradients: bool = True
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ (stage 3): the forward/backward parameter all-gathers move block-wise int8 (comm/quantized.py)."""
    zero_quantized_nontrainable_weights: bool = False
    """ZeRO++: the same for parameters with ``requires_grad=False``."""
    zero_hpz_partition_size: int = Field(1, ge=1)
    """ZeRO++ hpZ (stage 3): > 1 keeps a secondary copy of each parameter partitioned over groups of this many
    consecutive ranks (a node); gathers read it until the next optimizer step, so backward stays intra-node."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ (stage 3): gradients reduce-scattered as int4 by a two-level (intra-, inter-node) all-to-all
    over nodes of ``LOCAL_WORLD_SIZE`` ranks (the launcher's)."""
    round_robin_gradients: bool = False
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    ignore_unused_parameters: bool = True
    use_multi_rank_bucket_allreduce: bool = True
    sub_group_size: int = Field(1_000_000_000, gt=0)
    memory_efficient_linear: bool = True
    log_trace_cache_warnings: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    """DeepSpeed: keep Muon's momentum in memory instead of NVMe swap files; zerospeed always does (config/hints.py)."""
    # Stage 3 (DeepSpeed names and defaults).
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    stage3_model_persistence_threshold: int = Field(2**63 - 1, ge=0)
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Modules gathered whole under stage 3, no hooks inside (zero/stage3/leaves.py); DeepSpeed's default
    classes are Hugging Face's sparse MoE blocks."""
    stage3_module_granularity_threshold: int = Field(0, ge=0)
    """Modules of at most this many parameters per module below them become leaves (zero/stage3/leaves.py)."""
    stage3_use_all_reduce_for_fetch_params: bool = False
    """Gathers of several parameters run as one all-reduce of a zeroed buffer (same values, no unpacking of ranks)."""
    stage3_allgather_sequential: bool = False
    """One all-gather per parameter (no bucketing of a module's parameters into one collective)."""
    mics_shard_size: int = Field(-1, ge=-1)
    """MiCS (zero/stage3/mics.py): stage 3 partitioned within groups of this many consecutive ranks, replicated
    across them (gradients all-reduced over the replicas at each boundary); -1: off."""
    mics_hierarchical_params_gather: bool = False
    """MiCS: a shard group spanning nodes gathers across its nodes first, then inside each node."""
    zeropp_loco_param: dict[str, Any] | None = None
    """LoCo error feedback for qgZ's int4 gradients: ``{"err_beta": 0.8, "reset_T": 1024}`` (zero/stage3/qgz.py)."""
    override_module_apply: bool = True
    """zero.Init's nn.Module.apply override (DeepSpeed); always in effect here by other means (config/hints.py)."""
    enable_sanity_checks: bool = False
    """Stage 3: ``GatheredParameters`` without a modifier rank must leave its parameters unchanged, else a named
    error on every rank (zero/stage3/sanity.py)."""
    legacy_stage1: bool = False
    """DeepSpeed's pre-0.5.9 ZeRO-1 (removed there): read as stage 1, whose partitioning and math are the same."""
    pipeline_loading_checkpoint: bool = False
    """Stage 3: the ranks of a node read a checkpoint being loaded one after another, local rank 0 first
    (DeepSpeed's relay; runtime/checkpoint/turns.py)."""
    # ZeRO-Offload of the optimizer step and state (config/offload.py).
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    # ZeRO-Infinity: stage-3 parameter shards on the host or on disk (config/offload.py).
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    # ZenFlow: top-k columns stepped on the device, the rest accumulated for the host (config/zenflow.py).
    zenflow: ZenFlowConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _fp16_alias(cls, data: Any) -> Any:
        """``stage3_gather_fp16_weights_on_model_save`` is DeepSpeed's older name of the 16-bit key."""
        old, new = "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"
        if isinstance(data, dict) and old in data:
            data = dict(data)
            value = data.pop(old)
            data.setdefault(new, value)
        return data

    @model_validator(mode="before")
    @classmethod
    def _cpu_offload_aliases(cls, data: Any) -> Any:
        """DeepSpeed's deprecated ``cpu_offload`` / ``cpu_offload_param``: ``true`` is ``{"device": "cpu"}`` of
        ``offload_optimizer`` / ``offload_param``; giving both names is an error, as in DeepSpeed.
        ``cpu_offload_use_pin_memory`` has no effect in DeepSpeed either: a warning says so."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in _DEPRECATED_OFFLOAD.items():
            if old not in data:
                continue
            value = data.pop(old)
            if not isinstance(value, bool):
                raise ValueError(f"{old} must be true or false, got {value!r}")
            if new in data:
                raise ValueError(f"cannot give the deprecated '{old}' and its replacement '{new}' together "
                                 f"(DeepSpeed refuses this too); keep '{new}'")
            _log.warning("config key 'zero_optimization.%s' is deprecated (as in DeepSpeed): read as %s", old,
                         f"'{new}': {{\"device\": \"cpu\"}}" if value else f"no '{new}'")
            if value:
                data[new] = {"device": "cpu"}
        if "cpu_offload_use_pin_memory" in data:
            data.pop("cpu_offload_use_pin_memory")
            _log.warning("config key 'zero_optimization.cpu_offload_use_pin_memory' is deprecated and has no effect "
                         "(as in DeepSpeed): set offload_optimizer.pin_memory / offload_param.pin_memory instead")
        return data

    @field_validator("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                     "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                     mode="before")
    @classmethod
    def _auto(cls, v: object, info: object) -> object:
        if v == "auto":
            return _AUTO_DEFAULTS[info.field_name]  # type: ignore[attr-defined]
        return v

    @field_validator("zeropp_loco_param")
    @classmethod
    def _loco(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """DeepSpeed reads ``err_beta`` and ``reset_T`` (both required there); others are typos."""
        if v is None:
            return v
        unknown = set(v) - {"err_beta", "reset_T"}
        if unknown:
            raise ValueError(f"zeropp_loco_param takes err_beta and reset_T, got {sorted(unknown)}")
        beta, reset = v.get("err_beta", 0.8), v.get("reset_T", 1024)
        if not 0.0 <= float(beta) <= 1.0 or int(reset) < 1:
            raise ValueError(f"zeropp_loco_param needs 0 <= err_beta <= 1 and reset_T >= 1, got {beta}, {reset}")
        return {"err_beta": float(beta), "reset_T": int(reset)}

    @model_validator(mode="after")
    def _zenflow_needs_cpu_offload(self) -> "ZeroConfig":
        if self.zenflow is None:
            return self
        if self.offload_optimizer.device != "cpu":
            raise ValueError("zenflow needs offload_optimizer.device 'cpu' (as in DeepSpeed: ZenFlow splits a "
                             f"CPU-offloaded step), got '{self.offload_optimizer.device}'")
        if self.offload_optimizer.ratio < 1.0:
            raise ValueError("zenflow with offload_optimizer.ratio < 1 (partial offload) is not supported yet by "
                             "zerospeed; use one of them")
        return self

    @model_validator(mode="after")
    def _legacy_stage1_is_stage1(self) -> "ZeroConfig":
        """``legacy_stage1``: the same optimizer-state partitioning as stage 1 (DeepSpeed >= 0.5.9 refuses it;
        zerospeed reads it as the stage-1 alias it is mathematically; at another stage: runtime/plan.py refuses)."""
        if self.legacy_stage1:
            _log.warning("zero_optimization.legacy_stage1: read as ZeRO stage 1 (the same partitioning and math; "
                         "DeepSpeed >= 0.5.9 refuses the key)")
        return self

    @model_validator(mode="after")
    def _zeropp_needs_stage3(self) -> "ZeroConfig":
        """ZeRO++ hpZ / qgZ and MiCS act on stage 3's gathers and reduce-scatters only: a warning below it (ignored)."""
        on = [k for k, v in (("zero_hpz_partition_size", self.zero_hpz_partition_size > 1),
                             ("zero_quantized_gradients", self.zero_quantized_gradients),
                             ("mics_shard_size", self.mics_shard_size > 0)) if v]
        if on and self.stage < 3:
            _log.warning("zero_optimization.%s has no effect at ZeRO stage %d (ZeRO++ and MiCS need stage 3; as in "
                         "DeepSpeed, it is ignored)", " and ".join(on), self.stage)
        return self
