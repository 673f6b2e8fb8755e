"""``"optimizer": {"type": "Muon"}``: DeepSpeed's parameters and its split of each group into Muon and Adam halves.

Which half a parameter belongs to is DeepSpeed's rule (``deepspeed.set_optimizer_flags``): Muon when the
layer's shape has at least two dims and its name contains neither ``embed`` nor ``lm_head`` (case-insensitive);
Adam for everything else (biases, norms, embeddings, the output head). The shape is the layer's full shape,
also under ZeRO-3 where the module holds a placeholder. A parameter that already carries a ``use_muon``
attribute keeps it (DeepSpeed overwrites it; zerospeed lets the user decide, e.g. for a head named ``out``).

Each incoming group becomes up to two groups (``<prefix>-muon-params`` / ``<prefix>-adam-params``), settled
most-specific-last: the config's shared ``lr``/``weight_decay``, then ``muon_lr``/``adam_lr``, then the
group's own keys (only those its half takes: Muon ``lr, momentum, weight_decay, ns_method``; Adam ``lr,
betas, eps, weight_decay``), as DeepSpeed's engine does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from pydantic import Field, field_validator
from torch import nn

from zerospeed.config.base import Section
from zerospeed.config.errors import ConfigError, NotSupportedYetError

from .muon import MuonWithAuxAdam
from .newton_schulz import NS_METHODS
from .validate import parse_params

PATH = "optimizer.params"
_LOG = logging.getLogger("zerospeed.optim")
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_NOT_MATRIX_NAMES = ("embed", "lm_head")


class MuonParams(Section):
    """DeepSpeed's Muon parameters. Unset keys take each half's own default (``optim/muon.py``)."""

    lr: float | None = Field(None, ge=0)
    """Shared by both halves unless ``muon_lr`` / ``adam_lr`` is set (Muon default 0.02, Adam 3e-4)."""
    muon_lr: float | None = Field(None, ge=0)
    adam_lr: float | None = Field(None, ge=0)
    momentum: float | None = Field(None, ge=0, lt=1)
    weight_decay: float | None = Field(None, ge=0)
    ns_method: str | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = Field(None, ge=0)
    adam_w_mode: bool = True
    per_head_muon: bool = False
    torch_adam: bool = False
    fp32_optimizer_states: bool | None = None

    @field_validator("ns_method")
    @classmethod
    def _ns(cls, value: str | None) -> str | None:
        if value is not None and value not in NS_METHODS:
            raise ValueError(f"must be one of {list(NS_METHODS)}, got {value!r}")
        return value

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value

    def half_defaults(self, use_muon: bool) -> dict[str, Any]:
        """The config's settings for one half (``MUON_KEYS`` / ``ADAM_KEYS``), ``muon_lr``/``adam_lr`` first."""
        if use_muon:
            lr = self.lr if self.muon_lr is None else self.muon_lr
            values = {"lr": lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                      "ns_method": self.ns_method}
        else:
            lr = self.lr if self.adam_lr is None else self.adam_lr
            values = {"lr": lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}
        return {k: v for k, v in values.items() if v is not None}


def parse_muon_params(params: dict[str, Any] | None) -> MuonParams:
    p = parse_params(MuonParams, params, PATH)
    if p.torch_adam:
        # DeepSpeed's engine pops torch_adam before it builds any optimizer, so under Muon it selects nothing;
        # the auxiliary Adam here is MuonWithAuxAdam's own per-tensor update either way
        _LOG.info("%s.torch_adam has no effect under Muon: the auxiliary Adam is MuonWithAuxAdam's own update "
                  "(as in DeepSpeed, whose engine drops the key before building Muon)", PATH)
    if p.per_head_muon:
        raise NotSupportedYetError(f"{PATH}.per_head_muon", "per-head Muon is not supported yet by zerospeed")
    if p.fp32_optimizer_states is False:
        raise NotSupportedYetError(f"{PATH}.fp32_optimizer_states", "Muon with 16-bit optimizer states is not "
                                   "supported yet by zerospeed")
    return p


def wants_muon(name: str, shape: torch.Size | tuple[int, ...]) -> bool:
    """DeepSpeed's rule: a matrix (>= 2 dims) whose name mentions neither 'embed' nor 'lm_head'."""
    return len(shape) >= 2 and not any(k in name.lower() for k in _NOT_MATRIX_NAMES)


def tag_use_muon(model: nn.Module, shape_of: Callable[[nn.Parameter], torch.Size] | None = None) -> None:
    """Set ``use_muon`` on every parameter of ``model`` that has none (``shape_of``: the full shape)."""
    for name, p in model.named_parameters():
        if not hasattr(p, "use_muon"):
            p.use_muon = wants_muon(name, shape_of(p) if shape_of is not None else p.shape)  # type: ignore[attr-defined]


def split_muon_groups(groups: Iterable[dict[str, Any]], params: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each group split into its Muon and Adam halves (trainable parameters only), settings resolved."""
    p = parse_muon_params(params)
    groups = list(groups)
    out: list[dict[str, Any]] = []
    for index, group in enumerate(groups):
        tensors = [t for t in group["params"] if t.requires_grad]
        missing = [t for t in tensors if not hasattr(t, "use_muon")]
        if missing:
            raise ValueError(f"the Muon optimizer needs every parameter tagged with use_muon, and {len(missing)} "
                             "are not (parameters outside the model?); set `param.use_muon = True / False`")
        for use_muon, label, keys in ((True, "muon", MUON_KEYS), (False, "adam", ADAM_KEYS)):
            half = [t for t in tensors if bool(t.use_muon) is use_muon]
            if not half:
                continue
            settings = p.half_defaults(use_muon)
            settings.update({k: v for k, v in group.items() if k in keys})
            prefix = group.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append({**settings, "params": half, "use_muon": use_muon, "name": name})
    return out


def build_muon(params: dict[str, Any] | None, groups: list[dict[str, Any]]) -> MuonWithAuxAdam:
    """The config's Muon over groups already split (each has ``use_muon``; the engine splits them)."""
    p = parse_muon_params(params)
    for i, g in enumerate(groups):
        if "use_muon" not in g:
            raise ConfigError(PATH, f"parameter group {i} has no 'use_muon': build Muon's groups with "
                              "split_muon_groups (zerospeed.initialize does)")
    try:
        return MuonWithAuxAdam(groups, adam_w_mode=p.adam_w_mode)
    except ValueError as exc:
        raise ConfigError(PATH, str(exc)) from None
