"""Adam / AdamW with the second moment frozen: the update sparsified gradients need (``gradient_compression``).

Top-k gradient sparsification with error feedback delivers each entry rarely, as one large accumulated
value; fed to Adam's variance those rare large values inflate ``v`` and shrink the entry's steps by about
``sqrt(1 / ratio)``. After a dense warm-up of ``frozen_at`` steps, :func:`frozen_variance_step` keeps the
variance and its bias correction as they were at step ``frozen_at`` (1-bit Adam's idea), so the optimizer
becomes momentum SGD with a fixed diagonal preconditioner and the sum of the delivered gradients, which
error feedback keeps equal to the sum of the true ones, moves the weights as far as Adam would::

    m = beta1 m + (1 - beta1) g          (g: the averaged sparse gradient; + wd * p first for Adam's L2)
    p -= lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^frozen_at)) + eps)     (AdamW: p *= 1 - lr * wd first)

The state keys are torch's (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints are plain Adam state.
:func:`preconditioner` is the frozen ``1 / (sqrt(v_hat) + eps)``, by which the compressor ranks entries.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.config.errors import ConfigError

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)


def check_freeze_variance(section: Any, optimizer: object, offload: bool) -> None:
    """With ``section.freeze_variance`` (``gradient_compression``) on, refuse what :func:`frozen_variance_step`
    cannot step (names the key to change)."""
    if getattr(optimizer, "compresses_communication", False):
        raise ConfigError("gradient_compression", f"{type(optimizer).__name__} compresses its own communication: "
                          "remove it")
    for needs in ("momentum_correction", "preconditioned_selection", "momentum_exchange"):
        if getattr(section, needs) and not section.freeze_variance:
            raise ConfigError(f"gradient_compression.{needs}", "needs freeze_variance: true")
    if section.union_indices and not section.momentum_exchange:
        raise ConfigError("gradient_compression.union_indices", "needs momentum_exchange: true")
    if section.momentum_exchange:
        for other in ("momentum_correction", "preconditioned_selection"):
            if getattr(section, other):
                raise ConfigError(f"gradient_compression.{other}", "cannot be combined with momentum_exchange "
                                  "(it exchanges momentum already, ranked by |x|); remove one")
        if not section.error_feedback:
            raise ConfigError("gradient_compression.error_feedback", "momentum_exchange needs error_feedback: true")
    if section.local_variance and not section.momentum_exchange:
        raise ConfigError("gradient_compression.local_variance", "needs momentum_exchange: true")
    if not section.freeze_variance:
        return
    key = "gradient_compression.freeze_variance"
    if section.warmup_steps < 1:
        raise ConfigError(key, "needs warmup_steps >= 1 (the variance freezes at the end of a dense warm-up)")
    if offload:
        raise ConfigError(key, "does not work with zero_optimization.offload_optimizer")
    if not isinstance(optimizer, SUPPORTED):
        raise ConfigError(key, f"needs the Adam or AdamW optimizer, got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for option in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(option):
                raise ConfigError(key, f"does not support optimizer.params.{option}")


def _bias2(beta2: float, frozen_at: int) -> float:
    return 1.0 - beta2 ** max(1, frozen_at)


@torch.no_grad()
def preconditioner(optimizer: torch.optim.Optimizer, param: torch.Tensor, frozen_at: int) -> torch.Tensor:
    """``1 / (sqrt(v / (1 - beta2^frozen_at)) + eps)`` of ``param`` (zeros where it has no state yet)."""
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            state = optimizer.state.get(param)
            if not state or "exp_avg_sq" not in state:
                return torch.zeros_like(param, dtype=torch.float32)
            v_hat = state["exp_avg_sq"].float() / _bias2(group["betas"][1], frozen_at)
            return v_hat.sqrt_().add_(group["eps"]).reciprocal_()
    raise KeyError("parameter not in the optimizer")


@torch.no_grad()
def frozen_variance_step(optimizer: torch.optim.Optimizer, frozen_at: int, grad_is_momentum: bool = False,
                         grad_is_update: bool = False) -> None:
    """One Adam(W) step of every parameter with a gradient, ``exp_avg_sq`` left as it is. With
    ``grad_is_momentum`` (DGC's momentum correction: the ranks exchanged momentum) ``.grad`` becomes
    ``exp_avg`` as it is (1-bit Adam's rule) and the step is ``lr * exp_avg / denom``; with ``grad_is_update``
    (``momentum_exchange`` with ``local_variance``: the ranks exchanged the preconditioned step) it is
    ``lr * exp_avg``."""
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        bias2_sqrt = _bias2(beta2, frozen_at) ** 0.5
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = optimizer.state[p]
            if not state:  # no state from the warm-up: starts with v = 0 (as 1-bit Adam would)
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            step = float(state["step"])
            if wd != 0:
                if decoupled:
                    p.mul_(1 - lr * wd)
                else:
                    grad = grad.add(p, alpha=wd)
            if grad_is_update:
                state["exp_avg"].copy_(grad)
                p.add_(state["exp_avg"], alpha=-lr)
                continue
            if grad_is_momentum:
                state["exp_avg"].copy_(grad)
            else:
                state["exp_avg"].lerp_(grad, 1 - beta1)
            denom = (state["exp_avg_sq"].sqrt() / bias2_sqrt).add_(eps)
            p.addcdiv_(state["exp_avg"], denom, value=-lr if grad_is_momentum else -lr / (1 - beta1 ** step))
