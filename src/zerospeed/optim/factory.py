"""Build the optimizer named by ``optimizer.type`` from ``optimizer.params``, with DeepSpeed's meaning.

DeepSpeed's ``Adam`` is decoupled weight decay (AdamW) unless ``adam_w_mode`` is false; ``AdamW`` is always
decoupled; defaults are FusedAdam's (weight_decay 0, not torch AdamW's 0.01). ``Lamb`` is our own
:class:`~zerospeed.optim.lamb.Lamb`; ``Muon`` is DeepSpeed's ``MuonWithAuxAdam`` (``optim/muon_groups.py``).
Other names (``SGD``, ``Adagrad``, ...) are torch.optim classes given the params unchanged, as DeepSpeed does. Every key is checked: unknown keys and leftover "auto" values fail with
their key path.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from pydantic import Field, field_validator

from zerospeed.config.base import Section
from zerospeed.config.errors import ConfigError, NotSupportedYetError, did_you_mean

from .lamb import Lamb
from .muon_groups import MuonParams, build_muon  # noqa: F401  (config/schema.py lists MuonParams' keys)
from .hyper import check_hyperparameters
from .validate import parse_params, reject_auto

PATH = "optimizer.params"

# torch.optim classes accepted by name, parameters passed through unchanged (DeepSpeed's fallback).
_TORCH_PASSTHROUGH = ("SGD", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "ASGD", "Rprop", "Adafactor")
_TORCH_OPTIMIZERS = {n.lower(): n for n in _TORCH_PASSTHROUGH if hasattr(torch.optim, n)}

# DeepSpeed's 1-bit optimizers (zerospeed.optim.onebit): they exchange compressed momentum themselves.
ONEBIT_NAMES: tuple[str, ...] = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")

OPTIMIZER_NAMES: tuple[str, ...] = ("Adam", "AdamW", "Lamb", "Muon", *ONEBIT_NAMES, *_TORCH_OPTIMIZERS.values())

# DeepSpeed optimizer types zerospeed does not implement yet.
_NOT_YET = {
    "lion": "Lion",
    "muadam": "MuAdam",
    "muadamw": "MuAdamW",
    "musgd": "MuSGD",
}
_CPU_ADAM = {"cpuadam", "deepspeedcpuadam", "fusedadam", "cpuadagrad", "deepspeedcpuadagrad"}


def _check_betas(value: tuple[float, float]) -> tuple[float, float]:
    if not all(0.0 <= b < 1.0 for b in value):
        raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
    return value


class AdamParams(Section):
    """FusedAdam's parameters and defaults, plus the torch.optim.Adam(W) options DeepSpeed passes through."""

    lr: float = Field(1e-3, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    bias_correction: bool = True
    adam_w_mode: bool = True
    torch_adam: bool = False
    amsgrad: bool = False
    set_grad_none: bool = True
    maximize: bool = False
    foreach: bool | None = None
    fused: bool | None = None
    capturable: bool = False
    differentiable: bool = False

    _betas = field_validator("betas")(_check_betas)


class _AdamFamily(Section):
    """The parameters FusedLamb and DeepSpeed's 1-bit optimizers share, with their defaults."""

    lr: float = Field(1e-3, ge=0)
    bias_correction: bool = True
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, ge=0)
    eps_inside_sqrt: bool = False
    weight_decay: float = Field(0.0, ge=0)
    amsgrad: bool = False

    _betas = field_validator("betas")(_check_betas)


class _LambCoeffs(Section):
    """Lamb's trust-ratio bounds."""

    max_coeff: float = Field(10.0, ge=0)
    min_coeff: float = Field(0.01, ge=0)


class _OneBitComm(Section):
    """What DeepSpeed's 1-bit optimizers accept about their transport (``cuda_aware`` and
    ``comm_backend_name`` change nothing here: ``comm/`` chooses)."""

    cuda_aware: bool = False
    comm_backend_name: str = "nccl"


class _TorchBiasCorrection(Section):
    """zerospeed only: the 1-bit Adams with torch Adam's bias correction (``optim/onebit/adam.py``)."""

    zerospeed_bias_correction: bool = False


class LambParams(_AdamFamily, _LambCoeffs):
    """FusedLamb's parameters and defaults (max_grad_norm is rejected: use top-level gradient_clipping)."""


class OneBitAdamParams(_AdamFamily, _OneBitComm, _TorchBiasCorrection):
    """DeepSpeed's OnebitAdam parameters and defaults (``bias_correction``, ``eps_inside_sqrt`` and
    ``cuda_aware`` are accepted and, as in DeepSpeed, change nothing)."""

    freeze_step: int = Field(100000, ge=0)


class ZeroOneAdamParams(_AdamFamily, _OneBitComm, _TorchBiasCorrection):
    """DeepSpeed's ZeroOneAdam parameters and defaults (``bias_correction``, ``eps_inside_sqrt`` and
    ``cuda_aware`` are accepted and, as in DeepSpeed, change nothing)."""

    var_freeze_step: int = Field(100000, ge=0)
    var_update_scaler: int = Field(16, ge=1)
    local_step_scaler: int = Field(32678, ge=1)
    local_step_clipper: int = Field(16, ge=1)


class OneBitLambParams(_AdamFamily, _LambCoeffs, _OneBitComm):
    """DeepSpeed's OnebitLamb parameters and defaults (``bias_correction``, ``eps_inside_sqrt`` and
    ``cuda_aware`` are accepted and, as in DeepSpeed, change nothing)."""

    freeze_step: int = Field(100000, ge=0)
    coeff_beta: float = Field(0.9, ge=0, le=1)
    factor_max: float = Field(4.0, gt=0)
    factor_min: float = Field(0.5, gt=0)
    factor_threshold: float = Field(0.1, ge=0)


def build_optimizer(
    type_name: str, params: dict[str, Any], param_groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """Build ``optimizer.type`` over ``param_groups`` (dicts with "params" and optional per-group overrides)."""
    canonical = resolve_optimizer_name(type_name)
    params = dict(params or {})
    reject_auto(params, PATH)
    if canonical not in _TORCH_OPTIMIZERS.values():  # torch's classes first give their own range errors
        check_hyperparameters(params, PATH)
    if "max_grad_norm" in params:
        raise ConfigError(
            f"{PATH}.max_grad_norm",
            "is not an optimizer parameter (as in DeepSpeed); use the top-level 'gradient_clipping' key",
        )
    groups = [_copy_group(g) for g in param_groups]
    if canonical in ("Adam", "AdamW"):
        return _build_adam(canonical, params, groups)
    if canonical == "Lamb":
        return _build_lamb(params, groups)
    if canonical == "Muon":
        return build_muon(params, groups)
    if canonical in ONEBIT_NAMES:
        return _build_onebit(canonical, params, groups)
    built = _build_torch(getattr(torch.optim, canonical), params, groups)
    check_hyperparameters(params, PATH)  # what torch accepts but cannot train on (inf momentum, lr 1e30, ...)
    return built


def resolve_optimizer_name(type_name: str) -> str:
    """Canonical spelling of ``optimizer.type`` (case-insensitive), or a ConfigError naming the fix."""
    if not isinstance(type_name, str):
        raise ConfigError("optimizer.type", f"expected a string, got {type_name!r}")
    key = type_name.lower()
    by_lower = {n.lower(): n for n in OPTIMIZER_NAMES}
    if key in by_lower:
        return by_lower[key]
    if key in _NOT_YET:
        raise NotSupportedYetError("optimizer.type", f"DeepSpeed's '{_NOT_YET[key]}' optimizer is not supported yet")
    if key in _CPU_ADAM:
        raise ConfigError(
            "optimizer.type",
            f"'{type_name}' is not an optimizer type; use 'Adam' (or 'Adagrad') and turn on "
            "zero_optimization.offload_optimizer to run it on the CPU",
        )
    hint = did_you_mean(type_name, OPTIMIZER_NAMES) or did_you_mean(key, by_lower)
    supported = ", ".join(OPTIMIZER_NAMES)
    raise ConfigError("optimizer.type", f"unknown optimizer '{type_name}'.{hint} Supported: {supported}")


def _build_adam(canonical: str, params: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    p = parse_params(AdamParams, params, PATH)
    if not p.bias_correction:
        raise NotSupportedYetError(f"{PATH}.bias_correction", "Adam without bias correction is not supported yet")
    decoupled = canonical == "AdamW" or p.adam_w_mode
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    fused = _prefer_fused(groups) if p.fused is None and p.foreach is None and not (
        p.torch_adam or p.capturable or p.differentiable) else p.fused
    foreach = p.foreach if p.foreach is not None or fused else _prefer_foreach(groups)
    return cls(
        groups,
        lr=p.lr,
        betas=p.betas,
        eps=p.eps,
        weight_decay=p.weight_decay,
        amsgrad=p.amsgrad,
        maximize=p.maximize,
        foreach=foreach,
        fused=fused,
        capturable=p.capturable,
        differentiable=p.differentiable,
    )


def _build_lamb(params: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    p = parse_params(LambParams, params, PATH)
    if p.amsgrad:
        raise ConfigError(f"{PATH}.amsgrad", "Lamb has no AMSGrad variant (DeepSpeed's FusedLamb rejects it too)")
    if p.min_coeff > p.max_coeff:
        raise ConfigError(f"{PATH}.min_coeff", f"must be <= max_coeff ({p.max_coeff}), got {p.min_coeff}")
    kwargs = p.model_dump(exclude={"amsgrad"})
    return Lamb(groups, **kwargs)


def _build_onebit(canonical: str, params: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """A 1-bit optimizer; the engine builder binds its data-parallel group (``bind``)."""
    from .onebit import OnebitAdam, OnebitLamb, ZeroOneAdam

    model, cls = {"OneBitAdam": (OneBitAdamParams, OnebitAdam), "ZeroOneAdam": (ZeroOneAdamParams, ZeroOneAdam),
                  "OneBitLamb": (OneBitLambParams, OnebitLamb)}[canonical]
    p = parse_params(model, params, PATH)  # type: ignore[arg-type]
    if p.amsgrad:
        raise ConfigError(f"{PATH}.amsgrad", f"{canonical} does not support the AMSGrad variant (as in DeepSpeed)")
    try:
        return cls(groups, **p.model_dump(exclude={"amsgrad"}))
    except ValueError as exc:
        raise ConfigError(PATH, str(exc)) from None


def _build_torch(
    cls: type[torch.optim.Optimizer], params: dict[str, Any], groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """A torch.optim class given DeepSpeed's params as they are; names come from its signature."""
    known = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")]
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        if key not in known:
            raise ConfigError(f"{PATH}.{key}", f"unknown parameter for {cls.__name__}.{did_you_mean(key, known)}")
        kwargs[key] = tuple(value) if isinstance(value, list) else value
    if "foreach" in known and "foreach" not in kwargs and not kwargs.get("fused"):
        kwargs["foreach"] = _prefer_foreach(groups)
    try:
        return cls(groups, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(PATH, f"{cls.__name__} rejected the parameters {params}: {exc}") from None


def _copy_group(group: dict[str, Any]) -> dict[str, Any]:
    """A copy with "params" as a list: torch fills defaults into the dicts, keep the caller's intact."""
    if not isinstance(group, dict) or "params" not in group:
        raise ValueError(f"each parameter group must be a dict with a 'params' entry, got {group!r}")
    tensors = group["params"]
    return {**group, "params": [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)}


_FUSED_DTYPES = (torch.float32, torch.float64)  # 16-bit masters keep torch's loop (DeepSpeed's bf16 rounding)


def _prefer_fused(groups: list[dict[str, Any]]) -> bool | None:
    """DeepSpeed's default Adam(W) is a fused kernel (FusedAdam; its CPU build on a CPU accelerator), and
    ``torch_adam: true`` selects torch.optim's per-tensor loop. zerospeed's default is torch's own fused kernel
    where it serves (every parameter a dense fp32/fp64 host tensor): one pass over each tensor
    instead of one per elementwise op, about 4x faster per step on CPU (docs/benchmarks.md, issue 38), the
    same update to rounding (one ulp). Elsewhere torch's default (foreach on accelerators, ``_prefer_foreach``)."""
    tensors = [t for g in groups for t in g["params"]]
    if tensors and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype in _FUSED_DTYPES
                       and not t.is_sparse for t in tensors):
        return True
    return None


def _prefer_foreach(groups: list[dict[str, Any]]) -> bool | None:
    """Multi-tensor kernels where they are fast (all tensors on an accelerator); torch's default otherwise."""
    tensors = [t for g in groups for t in g["params"]]
    if tensors and all(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors):
        return True
    return None
