"""DeepSpeed's optimizer classes by name (``deepspeed.ops.adam.DeepSpeedCPUAdam``, ``FusedAdam``, ...).

Scripts construct them and hand them to ``initialize``. Each is a torch optimizer with DeepSpeed's
signature and defaults: the update is torch's (``Adam`` with ``decoupled_weight_decay`` for AdamW mode),
and under ``offload_optimizer`` the engine runs it through the same fused CPU kernel (``offload/cpu_adam``),
so there is no separate "CPU Adam" implementation to drift from the on-device one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..config import NotSupportedYetError
from .lamb import Lamb


def _bias_correction(bias_correction: bool, name: str) -> None:
    if not bias_correction:
        raise NotSupportedYetError("optimizer.params.bias_correction",
                                   f"{name}(bias_correction=False) is not supported yet by zerospeed")


class FusedAdam(torch.optim.Adam):
    """``deepspeed.ops.adam.FusedAdam``: Adam, AdamW when ``adam_w_mode`` (the default, as in DeepSpeed)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        _bias_correction(bias_correction, "FusedAdam")
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (as in DeepSpeed).")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """``deepspeed.ops.adam.DeepSpeedCPUAdam``: the optimizer DeepSpeed pairs with ``offload_optimizer``;
    AdamW when ``adamw_mode`` (the default). Its state stays fp32 (``fp32_optimizer_states``)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _bias_correction(bias_correction, "DeepSpeedCPUAdam")
        if amsgrad:
            raise NotSupportedYetError("optimizer.params.amsgrad", "DeepSpeedCPUAdam(amsgrad=True) is not supported "
                                       "(DeepSpeed does not support it either)")
        if not fp32_optimizer_states:
            raise NotSupportedYetError("optimizer.params.fp32_optimizer_states", "DeepSpeedCPUAdam("
                                       "fp32_optimizer_states=False) is not supported yet by zerospeed")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode)


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad or not fp32_optimizer_states:
            raise NotSupportedYetError("optimizer.params", "DeepSpeedCPUAdagrad(amsgrad=True or "
                                       "fp32_optimizer_states=False) is not supported yet by zerospeed")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


class FusedLamb(Lamb):
    """``deepspeed.ops.lamb.FusedLamb``: zerospeed's Lamb (DeepSpeed's update rule, see ``optim/lamb.py``)."""


__all__ = ["DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam", "FusedAdam", "FusedLamb"]
