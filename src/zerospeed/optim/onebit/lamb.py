"""1-bit LAMB (DeepSpeed's ``OnebitLamb``, https://arxiv.org/abs/2104.06069), on Gloo and NCCL.

After an initialising first call (state made, a step counted, no weight moved):

* warm-up, while the step count is below ``freeze_step``: the engine all-reduces the gradients; LAMB
  without bias correction: ``u = m / (sqrt(v) + eps) + wd p``, trust ratio ``||p|| / ||u||`` clamped to
  ``[min_coeff, max_coeff]``, ``p -= lr * ratio * u``. The ratios are averaged into ``lamb_coeff_freeze``
  (EMA with ``coeff_beta``); at ``freeze_step`` the variance is copied into ``exp_avg_sq_fresh``;
* compression, after it: the engine stops all-reducing. Each rank folds its local gradient into ``m``,
  scaled by a per-tensor ``scaling_coeff`` (fixed at the first compressed step: mean momentum scale over
  this tensor's, so all tensors weigh alike), and all momenta are averaged as **one** flat buffer by the
  1-bit all-reduce, then unscaled (times ``exp_avg_mask``). The variance ``v`` stays frozen; a fresh one
  is tracked from the gradient reconstructed out of the momentum change, and the frozen ratio is
  rescaled by ``factor = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))`` (blended by the share of the
  update that is not weight decay), clamped to ``[factor_min, factor_max]`` and to within
  ``factor_threshold`` of the last factor.

Differences from DeepSpeed: the phase follows the step count (no new initialising call after a load); a
tensor whose momentum is all zero at the first compressed step gets ``scaling_coeff`` 1 (DeepSpeed's
divides by zero); empty parameters are kept out of the exchange rather than removed from the groups.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ... import comm
from .base import CompressedOptimizer, apply_mask


class OnebitLamb(CompressedOptimizer):
    deepspeed_name = "1bit-Lamb"

    def __init__(self, params: Any, deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1) -> None:
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults, deepspeed, comm_backend_name, amsgrad, eps_inside_sqrt, cuda_aware)
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self.lamb_coeffs: list[float] = []

    # --- phase ------------------------------------------------------------------------------------
    @property
    def lamb_freeze_key(self) -> bool:
        """DeepSpeed's flag: true in the compression phase."""
        return self.initialize and self.first_step_count() >= self.freeze_step

    def wants_backward_allreduce(self) -> bool:
        return not self.lamb_freeze_key

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per tensor."""
        return self.lamb_coeffs

    def _live(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        return [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None and p.numel() > 0]

    # --- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        initialising = not self.initialize
        compressing = self.lamb_freeze_key
        live = self._live()
        for _, p in live:
            if p.grad.is_sparse:
                raise RuntimeError("1-bit Lamb does not support sparse gradients")
            state = self.state[p]
            if "step" not in state:
                state.update(step=0, lamb_coeff_freeze=0.0, last_factor=1.0, exp_avg=torch.zeros_like(p),
                             exp_avg_sq=torch.zeros_like(p), exp_avg_sq_fresh=torch.zeros_like(p))
            state["step"] += 1
        if initialising:
            return loss
        if not compressing:
            for group, p in live:
                self._warmup_update(group, p, p.grad, self.state[p])
        else:
            self._compressed_step(live)
        return loss

    def _warmup_update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> None:
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        beta1, beta2 = group["betas"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if state["step"] == self.freeze_step:
            state["exp_avg_sq_fresh"] = exp_avg_sq.detach().clone()
        weight_norm = p.pow(2).sum().sqrt()
        update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
        if group["weight_decay"] > 0.0:
            update += group["weight_decay"] * p
        update_norm = update.pow(2).sum().sqrt()
        coeff = 1.0
        if weight_norm != 0 and update_norm != 0:
            coeff = min(max((weight_norm / update_norm).item(), group["min_coeff"]), group["max_coeff"])
        if coeff != 1.0:
            state["lamb_coeff_freeze"] = self.coeff_beta * state["lamb_coeff_freeze"] + (1 - self.coeff_beta) * coeff
        self.lamb_coeffs.append(coeff)
        p.add_(-group["lr"] * coeff * update)

    def _compressed_step(self, live: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        last = [self.state[p]["exp_avg"].detach().clone() for _, p in live]
        if "scaling_coeff" not in self.state[live[0][1]]:
            self._set_scaling_coeffs(live)
        for group, p in live:
            state = self.state[p]
            beta1 = group["betas"][0]
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1).mul_(state["scaling_coeff"])
        self._exchange_momenta(live)
        for (group, p), m_last in zip(live, last):
            self._compressed_update(group, p, self.state[p], m_last)

    def _set_scaling_coeffs(self, live: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        scales = [(torch.linalg.vector_norm(self.state[p]["exp_avg"]) / math.sqrt(p.numel())).item() for _, p in live]
        united = sum(scales) / len(scales)
        for (_, p), s in zip(live, scales):
            self.state[p]["scaling_coeff"] = united / s if s > 0 else 1.0

    def _exchange_momenta(self, live: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        """All momenta as one flat buffer through the 1-bit all-reduce (one pair of error buffers)."""
        if self.world_size() == 1:
            return
        momenta = [self.state[p]["exp_avg"] for _, p in live]
        flat = torch.cat([m.reshape(-1) for m in momenta])
        we, se = self.error_buffers(live[0][1], flat.numel())
        averaged = comm.compressed_all_reduce(flat, we, se, self.group)
        offset = 0
        for m in momenta:
            m.copy_(averaged[offset:offset + m.numel()].view_as(m))
            offset += m.numel()

    def _compressed_update(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any],
                           m_last: torch.Tensor) -> None:
        exp_avg, exp_avg_sq, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
        beta1, beta2 = group["betas"]
        exp_avg.div_(state["scaling_coeff"])
        apply_mask(group, exp_avg)
        grad_reconstruct = (exp_avg - m_last * beta1) / (1 - beta1)
        fresh.mul_(beta2).addcmul_(grad_reconstruct, grad_reconstruct, value=1 - beta2)
        denom = exp_avg_sq.sqrt() + group["eps"]
        prelim = exp_avg / denom
        update = prelim + group["weight_decay"] * p if group["weight_decay"] > 0.0 else prelim
        update_norm = update.pow(2).sum().sqrt()
        factor = (denom / (fresh.sqrt() + group["eps"])).max().item()
        if group["weight_decay"] > 0.0:
            ratio = min(1.0, (prelim.pow(2).sum().sqrt() / update_norm).item())
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = state["last_factor"]
        factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
        state["last_factor"] = factor
        coeff = state["lamb_coeff_freeze"] * factor
        self.lamb_coeffs.append(coeff)
        p.add_(-group["lr"] * coeff * update)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """DeepSpeed's rules, plus: loaded in the warm-up phase, the frozen ratios and factors restart."""
        super().load_state_dict(state_dict)
        if not self.lamb_freeze_key:
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state.get(p)
                    if state:
                        state.update(lamb_coeff_freeze=0.0, last_factor=1.0)
                        state.pop("scaling_coeff", None)
