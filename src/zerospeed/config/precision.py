"""fp16 / bf16 sections (DeepSpeed names and defaults)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from .base import Section
from .data_types import DTYPE_NAMES


class Fp16Config(Section):
    """fp16 compute with fp32 master weights. ``loss_scale: 0`` means dynamic loss scaling.

    ``fp16_master_weights_and_grads`` (ZeRO 1-2 with CPU offload, as in DeepSpeed): the master partition is fp16
    (the gradients already are); the offloaded optimizer keeps its state in fp32.

    ``auto_cast``: the engine's forward casts floating-point positional inputs (nested in lists, tuples and
    dicts) to fp16, as DeepSpeed does. ``raise_error_at_min_scale`` (zerospeed's key for DeepSpeed's
    ``DynamicLossScaler`` argument of that name, which DeepSpeed's config does not expose): an overflow with the
    scale already at ``min_loss_scale`` raises instead of skipping every later step.

    As in DeepSpeed: ``loss_scale`` must be a finite number >= 0 (not a bool, a list...); ``loss_scale_window``
    and ``min_loss_scale`` must be positive only where they are used (fp16 enabled, dynamic scaling), and never
    a bool (a bool would pass as 1).
    """

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(0.0, ge=0, le=2.0**32, allow_inf_nan=False)  # above 2^32 every fp16 step overflows
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = 1000
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, allow_inf_nan=False)
    fp16_master_weights_and_grads: bool = False
    raise_error_at_min_scale: bool = True

    @field_validator("loss_scale", "loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _a_number(cls, v: Any, info: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError(f"{info.field_name} must be a number, got {type(v).__name__} {v!r}")
        return v

    @model_validator(mode="after")
    def _dynamic_scaling_positive(self) -> "Fp16Config":
        if self.enabled and self.loss_scale == 0:
            for name in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name} must be positive with dynamic loss scaling (loss_scale 0), "
                                     f"got {getattr(self, name)}")
        return self


class Bf16Config(Section):
    """bf16 compute with fp32 master weights and fp32 gradient accumulation.

    ``check_grad_overflow`` (DeepSpeed >= 0.19.3 default: true): a step whose gradients hold inf/nan on any
    rank is skipped on every rank (weights, optimizer state and schedule untouched; there is no loss scale).
    ``bf16_master_weights_and_grads`` (ZeRO 1-2): the master partition and the gradient buffers are bf16; the
    optimizer state stays fp32 (so, as in DeepSpeed, the optimizer must be offloaded to the CPU) unless
    ``bf16_optimizer_states`` keeps it in bf16 too (on the device, or on the host under CPU offload).
    """

    enabled: bool = False
    immediate_grad_update: bool = False  # an accepted hint (config/hints.py): always what true asks for
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


class TorchAutocastConfig(Section):
    """``torch_autocast`` (DeepSpeed's names): the engine's forward runs inside ``torch.autocast``.

    The parameters stay in the precision mode's dtype (fp32 unless fp16/bf16 is enabled); the ops that autocast
    lists run in ``dtype``. ``dtype`` None: the device's autocast default (bf16 on CPU, fp16 on CUDA), as
    ``torch.autocast`` without a dtype. ``lower_precision_safe_modules``: the classes (``package.Class``)
    whose parameters' gradients are reduced in the autocast dtype under ZeRO 1-3 (as DeepSpeed); None: Linear,
    Conv1d/2d/3d.
    """

    enabled: bool = False
    dtype: str | None = None
    lower_precision_safe_modules: list[str] | None = None

    @field_validator("dtype")
    @classmethod
    def _known(cls, v: Any) -> Any:
        if v is not None and str(v).lower() not in DTYPE_NAMES:
            raise ValueError(f"invalid dtype for torch autocast {v!r}; use one of bfloat16, float16 (bf16, fp16)")
        return v


def check_master_weights(fp16: Fp16Config, bf16: Bf16Config, grad_accum_dtype: str | None = None) -> None:
    """DeepSpeed's rules for 16-bit master weights (its config asserts), as ConfigErrors naming the key; the
    ones that involve the stage or offload are rows of ``runtime/plan.py``'s table."""
    from .errors import ConfigError

    if bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        raise ConfigError("bf16.bf16_optimizer_states", "requires bf16.bf16_master_weights_and_grads to be enabled "
                                                        "(as in DeepSpeed)")
    for section, key, name in ((fp16, "fp16_master_weights_and_grads", "fp16"),
                               (bf16, "bf16_master_weights_and_grads", "bf16")):
        if not getattr(section, key):
            continue
        if not section.enabled:
            raise ConfigError(f"{name}.{key}", f"keeps the master weights in {name}, but {name}.enabled is false: "
                                               f"enable {name} or remove the key")
        if grad_accum_dtype is not None and DTYPE_NAMES[grad_accum_dtype.lower()] != DTYPE_NAMES[name]:
            raise ConfigError("data_types.grad_accum_dtype", f"{grad_accum_dtype!r} conflicts with {name}.{key} (the "
                                                             f"gradients are {name} too): remove one")
