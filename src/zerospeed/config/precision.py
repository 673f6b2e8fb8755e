"""fp16 / bf16 sections (DeepSpeed names and defaults)."""

from __future__ import annotations

from pydantic import Field

from .base import Section


class Fp16Config(Section):
    """fp16 compute with fp32 master weights. ``loss_scale: 0`` means dynamic loss scaling."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(0.0, ge=0)
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, ge=1)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0)
    fp16_master_weights_and_grads: bool = False


class Bf16Config(Section):
    """bf16 compute with fp32 master weights and fp32 gradient accumulation."""

    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = False
