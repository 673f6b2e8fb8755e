"""``deepspeed.runtime.zero.config`` / ``offload_config``: DeepSpeed's ZeRO config objects over zerospeed's
``zero_optimization`` section (``config/zero.py``).

``DeepSpeedZeroConfig(**section)`` validates the section with zerospeed's own model (same keys, defaults,
deprecated names and errors) and reads it under DeepSpeed's field names: DeepSpeed calls the ``stage3_*``
keys ``prefetch_bucket_size``, ``max_reuse_distance``, ... (the ``stage3_`` names are its aliases), leaves
``offload_param`` / ``offload_optimizer`` ``None`` unless the section names them, and resolves an unset
``overlap_comm`` to "on at stage 3". Nothing is parsed twice or kept apart from zerospeed's section.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Any

from ..config.offload import OffloadOptimizerConfig, OffloadParamConfig
from ..config.zero import ZeroConfig

# DeepSpeed's field name -> zerospeed's key (DeepSpeed accepts the ``stage3_*`` key as the field's alias)
DS_FIELD_NAMES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
}
# DeepSpeed fields zerospeed's section does not take (a key given is refused by the section), at their defaults
DS_ONLY_DEFAULTS: dict[str, Any] = {
    "pipeline_loading_checkpoint": False, "compute_grad_norm": True, "legacy_stage1": False,
    "parameter_alignment": False, "override_module_apply": True, "enable_sanity_checks": False,
    "allgather_sequential": False,
}
_OPTIONAL_SECTIONS = ("offload_param", "offload_optimizer", "zenflow")


class ZeroStageEnum(IntEnum):
    """DeepSpeed's names of the ZeRO stages (equal to the stage numbers)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's offload devices (equal to the strings zerospeed's sections hold)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


DeepSpeedZeroOffloadParamConfig = OffloadParamConfig


class DeepSpeedZeroOffloadOptimizerConfig(OffloadOptimizerConfig):
    """zerospeed's ``offload_optimizer`` section with DeepSpeed's derived ``pipeline`` flag."""

    @property
    def pipeline(self) -> bool:
        """DeepSpeed: the pipelined NVMe swapper is on when reads or writes are pipelined."""
        return self.pipeline_read or self.pipeline_write


class DeepSpeedZeroConfig:
    """DeepSpeed's ZeRO config object: zerospeed's validated section, read with DeepSpeed's field names."""

    def __init__(self, **section: Any) -> None:
        given = {k: v for k, v in section.items() if not (k in _OPTIONAL_SECTIONS and v is None)}
        self.section: ZeroConfig = ZeroConfig.parse_section(given, "zero_optimization")

    @property
    def stage(self) -> ZeroStageEnum:
        return ZeroStageEnum(self.section.stage)

    @property
    def overlap_comm(self) -> bool:
        """Unset: on at stage 3 only, as DeepSpeed resolves it."""
        value = self.section.overlap_comm
        return self.section.stage == 3 if value is None else value

    @property
    def offload_param(self) -> OffloadParamConfig | None:
        return self.section.offload_param if "offload_param" in self.section.model_fields_set else None

    @property
    def offload_optimizer(self) -> DeepSpeedZeroOffloadOptimizerConfig | None:
        if "offload_optimizer" not in self.section.model_fields_set:
            return None
        return DeepSpeedZeroOffloadOptimizerConfig.model_validate(self.section.offload_optimizer.model_dump())

    def __getattr__(self, name: str) -> Any:
        if name == "section":
            raise AttributeError(name)
        if name in DS_ONLY_DEFAULTS:
            return DS_ONLY_DEFAULTS[name]
        return getattr(self.section, DS_FIELD_NAMES.get(name, name))

    def __repr__(self) -> str:
        return f"DeepSpeedZeroConfig({self.section!r})"


__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZeroStageEnum"]
