"""Build the schedule named by ``scheduler.type`` from ``scheduler.params`` (DeepSpeed's names and defaults)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from zerospeed.config.base import Section
from zerospeed.config.errors import ConfigError, NotSupportedYetError, did_you_mean

from ..hyper import check_hyperparameters
from ..validate import parse_params, reject_auto
from .base import LRSchedule
from .one_cycle import OneCycle
from .range_test import LRRangeTest
from .warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

PATH = "scheduler.params"
PerGroup = float | list[float]
WarmupType = Literal["log", "linear"]


class WarmupLRParams(Section):
    warmup_min_lr: PerGroup = 0.0
    warmup_max_lr: PerGroup | None = None
    warmup_num_steps: int = Field(1000, gt=0)
    warmup_type: WarmupType = "log"


class WarmupDecayLRParams(Section):
    total_num_steps: int = Field(ge=0)
    warmup_min_lr: PerGroup = 0.0
    warmup_max_lr: PerGroup = 0.001
    warmup_num_steps: int = Field(1000, gt=0)
    warmup_type: WarmupType = "log"


class WarmupCosineLRParams(Section):
    total_num_steps: int = Field(ge=0)
    warmup_min_ratio: float = Field(0.0, ge=0)
    warmup_num_steps: int = Field(1000, gt=0)
    cos_min_ratio: float = Field(0.0001, ge=0)
    warmup_type: WarmupType = "log"


class OneCycleParams(Section):
    cycle_min_lr: PerGroup
    cycle_max_lr: PerGroup
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = Field(2000, gt=0)
    cycle_second_step_size: int | None = Field(None, ge=0)  # 0: the lr only climbs (DeepSpeed's step_ratio 1)
    cycle_first_stair_count: int = Field(0, ge=0)
    cycle_second_stair_count: int | None = Field(None, ge=0)
    decay_step_size: int = Field(0, ge=0)
    cycle_momentum: bool = True
    cycle_min_mom: PerGroup = 0.8
    cycle_max_mom: PerGroup = 0.9
    decay_mom_rate: float = 0.0


class LRRangeTestParams(Section):
    lr_range_test_min_lr: PerGroup = 1e-3
    lr_range_test_step_size: int = Field(2000, gt=0)
    lr_range_test_step_rate: float = 1.0
    lr_range_test_staircase: bool = False


_SCHEDULES: dict[str, tuple[type[LRSchedule], type[Section]]] = {
    "WarmupLR": (WarmupLR, WarmupLRParams),
    "WarmupDecayLR": (WarmupDecayLR, WarmupDecayLRParams),
    "WarmupCosineLR": (WarmupCosineLR, WarmupCosineLRParams),
    "OneCycle": (OneCycle, OneCycleParams),
    "LRRangeTest": (LRRangeTest, LRRangeTestParams),
}
SCHEDULER_NAMES: tuple[str, ...] = tuple(_SCHEDULES)


def build_scheduler(type_name: str, params: dict[str, Any], optimizer: Any) -> LRSchedule:
    """Build ``scheduler.type`` over ``optimizer``; its constructor writes the first step's lrs."""
    name = resolve_scheduler_name(type_name)
    cls, model = _SCHEDULES[name]
    params = dict(params or {})
    reject_auto(params, PATH)
    check_hyperparameters(params, PATH)
    if "last_batch_iteration" in params:
        raise NotSupportedYetError(
            f"{PATH}.last_batch_iteration",
            "is not supported; resume a schedule by loading its checkpoint (scheduler.load_state_dict)",
        )
    parsed = parse_params(model, params, PATH)
    return cls(optimizer, **parsed.model_dump())


def resolve_scheduler_name(type_name: str) -> str:
    """Canonical spelling of ``scheduler.type`` (case-insensitive), or a ConfigError naming the fix."""
    if not isinstance(type_name, str):
        raise ConfigError("scheduler.type", f"expected a string, got {type_name!r}")
    by_lower = {n.lower(): n for n in SCHEDULER_NAMES}
    if type_name.lower() in by_lower:
        return by_lower[type_name.lower()]
    if isinstance(getattr(torch.optim.lr_scheduler, type_name, None), type):
        raise NotSupportedYetError(
            "scheduler.type",
            f"torch scheduler '{type_name}' is not supported yet; use one of {', '.join(SCHEDULER_NAMES)}",
        )
    hint = did_you_mean(type_name, SCHEDULER_NAMES) or did_you_mean(type_name.lower(), by_lower)
    supported = ", ".join(SCHEDULER_NAMES)
    raise ConfigError("scheduler.type", f"unknown scheduler '{type_name}'.{hint} Supported: {supported}")
