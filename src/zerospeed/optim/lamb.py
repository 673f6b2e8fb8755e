"""LAMB: Adam's step rescaled, per parameter tensor, by a clipped trust ratio ||w|| / ||update||.

Follows DeepSpeed's FusedLamb (Algorithm 2 of https://arxiv.org/abs/1904.00962) with torch ops, so it runs
on any device::

    m = b1 m + (1 - b1) g              v = b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t)             v_hat = v / (1 - b2^t)          (if bias_correction)
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w                 (sqrt(v_hat + eps) if eps_inside_sqrt)
    r = clamp(||w|| / ||u||, min_coeff, max_coeff), or 1 when either norm is 0
    w = w - lr * r * u

The trust ratio is computed on whatever tensor the optimizer holds: under ZeRO sharding that is a shard,
exactly as DeepSpeed does with its flat partitions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer


class Lamb(Optimizer):
    """LAMB with DeepSpeed FusedLamb's parameters and defaults (trust ratio per parameter tensor)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if eps < 0.0:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got min_coeff={min_coeff} max_coeff={max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.lamb_coeffs: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                self.lamb_coeffs.append(self._update(p, group))
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """One LAMB step of tensor ``p``; returns its trust ratio (a 0-d tensor, no host sync)."""
        grad = p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype)
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        step = int(state["step"].item())
        beta1, beta2 = group["betas"]

        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bc1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
        bc2 = 1.0 - beta2**step if group["bias_correction"] else 1.0

        v_hat = exp_avg_sq / bc2
        if group["eps_inside_sqrt"]:
            denom = v_hat.add_(group["eps"]).sqrt_()
        else:
            denom = v_hat.sqrt_().add_(group["eps"])
        update = (exp_avg / bc1).div_(denom)
        if group["weight_decay"] != 0.0:
            update.add_(p, alpha=group["weight_decay"])

        w_norm = torch.linalg.vector_norm(p)
        u_norm = torch.linalg.vector_norm(update)
        ratio = torch.where(
            (w_norm > 0) & (u_norm > 0),
            (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
            torch.ones_like(w_norm),
        )
        p.sub_(update.mul_(ratio * group["lr"]))
        return ratio

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios of the last step, one per updated tensor (as DeepSpeed's FusedLamb reports)."""
        return [float(c) for c in self.lamb_coeffs]
