"""1-bit Adam (DeepSpeed's ``OnebitAdam``, https://arxiv.org/abs/2102.02888), on Gloo and NCCL.

Three phases, counted by ``state['step']``:

* the first call initialises: it creates the state and counts a step but moves no weight (DeepSpeed's);
* warm-up, while the step count is below ``freeze_step``: the engine all-reduces the gradients and the
  update is Adam **without bias correction** (DeepSpeed's), weight decay added to the update:
  ``m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  p -= lr (m / (sqrt(v) + eps) + wd p)``;
* compression, once a step has reached ``freeze_step``: the engine stops all-reducing; each rank folds its
  local gradient into ``m``, ``m`` is averaged by the error-compensated 1-bit all-reduce (times
  ``exp_avg_mask``), and ``v`` stays frozen. A group with ``non_freeze: true`` keeps full-precision
  gradient averaging and updates ``v``.

``bias_correction``, ``eps_inside_sqrt`` and ``cuda_aware`` are accepted and, as in DeepSpeed, change
nothing. ``zerospeed_bias_correction`` (zerospeed only, off by default; DeepSpeed refuses the key) is where
DeepSpeed is weak on short runs: without bias correction the warm-up steps are 3-6x Adam's and the frozen
variance is ``1 - b2^freeze_step`` of a settled one. With it the warm-up is torch Adam's update
(``m / (1 - b1^s)`` over ``sqrt(v / (1 - b2^s))``, ``s`` the updates so far) and compression divides the
frozen variance by ``1 - b2^(freeze_step - 1)``, its bias correction at the freeze.

Differences from DeepSpeed: the phase follows the step count, so a loaded checkpoint resumes in its phase
without another initialisation call, and the error buffers live outside ``state`` (never saved).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ... import comm
from .base import CompressedOptimizer


class OnebitAdam(CompressedOptimizer):
    deepspeed_name = "1bit-Adam"

    def __init__(self, params: Any, deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl",
                 zerospeed_bias_correction: bool = False) -> None:
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, deepspeed, comm_backend_name, amsgrad, eps_inside_sqrt, cuda_aware)
        self.freeze_step = freeze_step
        self.zerospeed_bias_correction = zerospeed_bias_correction

    # --- phase ------------------------------------------------------------------------------------
    @property
    def adam_freeze_key(self) -> bool:
        """DeepSpeed's flag: true in the compression phase."""
        return self.initialize and self.first_step_count() >= self.freeze_step

    def wants_backward_allreduce(self) -> bool:
        return not self.adam_freeze_key

    # --- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        initialising = not self.initialize
        compressing = self.adam_freeze_key
        for group, p in self._with_grads("1-bit Adam"):
            state = self.state[p]
            if len(state) == 0:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            if not initialising:
                self._update(group, p, p.grad, state, compressing)
        return loss

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                compressing: bool) -> None:
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        beta1, beta2 = group["betas"]
        if not compressing or group.get("non_freeze", False):
            if compressing:  # a non-frozen group: full-precision gradient average, variance still updated
                grad = grad.clone()
                comm.all_reduce(grad, group=self.group)
                grad.mul_(1.0 / self.world_size())
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        else:
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg.copy_(self.compressed_average(group, p, exp_avg))
        if self.zerospeed_bias_correction and not group.get("non_freeze", False):
            s = state["step"] - 1 if not compressing else self.freeze_step - 1  # variance updates so far
            m = exp_avg if compressing else exp_avg / (1 - beta1 ** s)
            update = m / ((exp_avg_sq / (1 - beta2 ** max(1, s))).sqrt() + group["eps"])
        else:
            update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
        if group["weight_decay"] > 0.0:
            update += group["weight_decay"] * p
        p.add_(-group["lr"] * update)
