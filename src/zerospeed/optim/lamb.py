"""LAMB: Adam's step rescaled, per parameter tensor, by a clipped trust ratio ||w|| / ||update||.

Follows DeepSpeed's FusedLamb (Algorithm 2 of https://arxiv.org/abs/1904.00962; its CUDA kernel bias-corrects
m and v themselves) with torch ops, so it runs on any device::

    m = b1 m + (1 - b1) g              v = b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t)             v_hat = v / (1 - b2^t)          (if bias_correction)
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w                 (sqrt(v_hat + eps) if eps_inside_sqrt)
    r = clamp(||w|| / ||u||, min_coeff, max_coeff), or 1 when either norm is 0
    w = w - lr * r * u

Two passes, as the kernel does: the first updates m and v and sums ``w^2`` and ``u^2`` per tensor; the second
recomputes ``u`` (no update-sized buffer is kept) and applies it. Under ZeRO each tensor the optimizer holds is
one rank's *shard* of a parameter (zero-padded), so the ZeRO optimizer sets :attr:`Lamb.shard_norm_reducer`:
the vector of every tensor's partial sums is summed across the shards in one collective between the passes,
and the trust ratio is the whole parameter's, as on one process (DeepSpeed computes it on its flat partitions).
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
        # Set by the ZeRO optimizer when each tensor is a shard: takes the flat vector [w_sq_0, u_sq_0, w_sq_1,
        # ...] of this rank's partial sums and returns it summed over the shards (one collective per step).
        self.shard_norm_reducer: Callable[[torch.Tensor], torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo: list[tuple[torch.Tensor, dict[str, Any], tuple[float, float]]] = []
        partial: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                corrections = self._update_moments(p, group)
                update = self._direction(p, group, corrections)
                partial.append(torch.linalg.vector_norm(p).square().to(torch.float64))
                partial.append(torch.linalg.vector_norm(update).square().to(torch.float64))
                todo.append((p, group, corrections))
        sums = torch.stack(partial) if partial else torch.zeros(0, dtype=torch.float64)
        if self.shard_norm_reducer is not None:
            sums = self.shard_norm_reducer(sums)
        norms = sums.sqrt().view(-1, 2)
        self.lamb_coeffs = []
        for (p, group, corrections), (w_norm, u_norm) in zip(todo, norms):
            ratio = torch.where(
                (w_norm > 0) & (u_norm > 0),
                (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
                torch.ones_like(w_norm),
            )
            update = self._direction(p, group, corrections)
            p.sub_(update.mul_((ratio * group["lr"]).to(update.dtype)))
            self.lamb_coeffs.append(ratio)
        return loss

    def _update_moments(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[float, float]:
        """Advance tensor ``p``'s step, m and v; return the bias corrections (1 - b1^t, 1 - b2^t)."""
        grad = p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype)
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = int(state["step"].item())
        beta1, beta2 = group["betas"]
        state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if not group["bias_correction"]:
            return 1.0, 1.0
        return 1.0 - beta1**step, 1.0 - beta2**step

    def _direction(self, p: torch.Tensor, group: dict[str, Any], corrections: tuple[float, float]) -> torch.Tensor:
        """The Adam-style update ``u`` of ``p`` from its current m and v (a new tensor)."""
        state = self.state[p]
        bc1, bc2 = corrections
        v_hat = state["exp_avg_sq"] / bc2
        if group["eps_inside_sqrt"]:
            denom = v_hat.add_(group["eps"]).sqrt_()
        else:
            denom = v_hat.sqrt_().add_(group["eps"])
        update = (state["exp_avg"] / bc1).div_(denom)
        if group["weight_decay"] != 0.0:
            update.add_(p, alpha=group["weight_decay"])
        return update

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios of the last step, one per updated tensor (as DeepSpeed's FusedLamb reports)."""
        return [float(c) for c in self.lamb_coeffs]
