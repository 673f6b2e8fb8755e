"""0/1 Adam (DeepSpeed's ``ZeroOneAdam``, https://arxiv.org/abs/2202.06009), on Gloo and NCCL.

After an initialising first call (state made, a step counted, no weight moved), two phases:

* variance updates, while the step count is at most ``var_freeze_step``: on steps that are a multiple of
  ``var_interval`` the engine all-reduces the gradients and both moments are updated; on the other steps
  the local gradient is averaged by the 1-bit all-reduce and only the momentum moves. Every
  ``var_update_scaler`` variance updates the interval doubles (1, 2, 4, ...);
* local steps, after it: the variance is frozen and each rank steps on its local gradient, accumulating
  its own weight change; every ``local_step_interval`` steps the change is undone, turned back into
  momentum units (times ``sqrt(v) + eps``), averaged by the 1-bit all-reduce, and applied; the momentum
  becomes that average over the learning rates summed since. Every ``local_step_scaler`` steps the
  interval doubles, up to ``local_step_clipper``. The error buffers are reset when this phase starts.

The update is Adam without bias correction, weight decay added to it (as in DeepSpeed).
``zerospeed_bias_correction`` (zerospeed only, off by default; DeepSpeed refuses the key) adds torch Adam's
bias corrections, counted the way 0/1 Adam updates its moments: the momentum moves on every step after the
initialising one (``s = step - 1`` updates), the variance only on variance-update steps (``k`` so far:
``log2(var_interval) * var_update_scaler + var_counter``), so the denominator is ``sqrt(v / (1 - b2^k)) + eps``
and, before the freeze, the momentum is divided by ``1 - b1^s``. While every step updates the variance
(``var_interval`` 1) that is torch Adam's update exactly. In the local-step phase ``k`` is the frozen count
(the local steps and their synchronisation use the corrected denominator) and the momentum is taken as it is
(``1 - b1^s`` is within 2e-3 of 1 after 60 steps, and the synchronised momentum is an average of used ones).

Differences from DeepSpeed: the phase follows the step count (a loaded checkpoint needs no new initialising
call); at world 1 the non-all-reduce steps still update the momentum (DeepSpeed's skips it there).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import CompressedOptimizer


class ZeroOneAdam(CompressedOptimizer):
    deepspeed_name = "0/1 Adam"

    def __init__(self, params: Any, deepspeed: Any = None, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl",
                 zerospeed_bias_correction: bool = False) -> None:
        for name, value in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                            ("local_step_clipper", local_step_clipper)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, deepspeed, comm_backend_name, amsgrad, eps_inside_sqrt, cuda_aware)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.zerospeed_bias_correction = zerospeed_bias_correction

    # --- phase ------------------------------------------------------------------------------------
    @property
    def freeze_key(self) -> bool:
        """DeepSpeed's flag: the variance is frozen (local-step phase)."""
        return self.initialize and self.first_step_count() > self.var_freeze_step

    def wants_backward_allreduce(self) -> bool:
        """All-reduce before the next step only when it updates the variance (DeepSpeed's rule)."""
        if not self.initialize:
            return True
        if self.freeze_key:
            return False
        state = self._first_state()
        return (state["step"] + 1) % state["var_interval"] == 0

    def _first_state(self) -> dict[str, Any]:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    return state
        raise AssertionError("no parameter has a state yet")

    # --- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        initialising = not self.initialize
        frozen = self.freeze_key
        for group, p in self._with_grads("0/1 Adam"):
            state = self.state[p]
            if len(state) == 0:
                self._init_state(p, state)
            state["step"] += 1
            if not initialising:
                self._update(group, p, p.grad, state, frozen)
        if not initialising and not frozen and self.freeze_key:
            self.reset_errors()  # the local-step phase starts with fresh error buffers (DeepSpeed's)
        return loss

    @staticmethod
    def _init_state(p: torch.Tensor, state: dict[str, Any]) -> None:
        state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                     momentum_accumulator=torch.zeros_like(p), var_interval=1, var_counter=0,
                     local_step_interval=1, local_step_counter=0, lrs=0.0)

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                frozen: bool) -> None:
        exp_avg, exp_avg_sq, acc = state["exp_avg"], state["exp_avg_sq"], state["momentum_accumulator"]
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        step = state["step"]
        if not frozen:
            if step % state["var_interval"] == 0:  # the engine all-reduced this gradient
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            else:
                exp_avg.mul_(beta1).add_(self.compressed_average(group, p, grad.clone()), alpha=1 - beta1)
        else:
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            state["lrs"] += lr
        if self.zerospeed_bias_correction:
            k = self._var_updates(state) + (not frozen and step % state["var_interval"] == 0)
            m = exp_avg if frozen else exp_avg / (1 - beta1 ** (step - 1))
            update = m / self._denom(group, exp_avg_sq, k)
        else:
            update = exp_avg / (exp_avg_sq.sqrt() + eps)
        if group["weight_decay"] > 0.0:
            update += group["weight_decay"] * p
        p.add_(-lr * update)
        if frozen:
            acc.add_(-lr * update)
            if step % state["local_step_interval"] == 0:
                self._sync_local_steps(group, p, state)
            state["local_step_counter"] += 1
            if state["local_step_counter"] == self.local_step_scaler:
                state["local_step_counter"] = 0
                state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
        elif step % state["var_interval"] == 0:
            state["var_counter"] += 1
            if state["var_counter"] == self.var_update_scaler:
                state["var_counter"] = 0
                state["var_interval"] *= 2

    def _sync_local_steps(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> None:
        """Undo this rank's local steps and apply the 1-bit average of every rank's, in momentum units."""
        exp_avg, exp_avg_sq, acc = state["exp_avg"], state["exp_avg_sq"], state["momentum_accumulator"]
        if self.zerospeed_bias_correction:
            denom = self._denom(group, exp_avg_sq, self._var_updates(state))
        else:
            denom = exp_avg_sq.sqrt() + group["eps"]
        p.add_(-1 * acc)
        acc.mul_(denom)
        acc.copy_(self.compressed_average(group, p, acc.clone()))
        exp_avg.zero_().add_(acc / state["lrs"], alpha=-1)
        p.add_(acc / denom)
        acc.zero_()
        state["lrs"] = 0.0

    def _var_updates(self, state: dict[str, Any]) -> int:
        """Variance updates counted so far: the interval doubles every ``var_update_scaler`` of them."""
        return (int(state["var_interval"]).bit_length() - 1) * self.var_update_scaler + int(state["var_counter"])

    @staticmethod
    def _denom(group: dict[str, Any], exp_avg_sq: torch.Tensor, k: int) -> torch.Tensor:
        """``sqrt(v / (1 - b2^k)) + eps`` (``zerospeed_bias_correction``; ``k`` variance updates)."""
        return (exp_avg_sq / (1 - group["betas"][1] ** max(1, k))).sqrt() + group["eps"]
