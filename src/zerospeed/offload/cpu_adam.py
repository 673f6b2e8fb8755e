"""Element-wise optimizer steps on flat fp32 host pieces: Adam/AdamW and Adagrad.

Each kernel is PyTorch's fused CPU kernel (``_fused_adam(w)_``, ``_fused_adagrad_``): one vectorised pass
over parameter, gradient and state, split across the intra-op threads. Measured on this machine (2 cores,
100M parameters, ``benchmarks/bench_cpu_adam.py``) it runs ~1.6G parameters/s: ~4.7x torch's ``foreach``
AdamW and ~5x our own vectorised multi-op version, so zerospeed does not ship its own; the math is torch's,
so an offloaded step equals the on-device one. Hyperparameters come from the torch optimizer's
``param_groups`` (so schedulers keep working); the state keys are torch's, so checkpoints are the same.
Optimizers without a flat kernel (SGD, Lamb, ...) run their own ``step()`` on host tensors under CPU
offload (see ``stepper``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..optim.lamb import Lamb


@dataclass(frozen=True)
class FlatKernel:
    """The step of one optimizer type on lists of flat pieces (all pieces share one step count)."""

    name: str
    state_keys: tuple[str, ...]

    def initial(self, key: str, group: dict[str, Any]) -> float:
        if self.name == "adagrad":
            return float(group.get("initial_accumulator_value", 0.0))
        return 0.0

    def check(self, group: dict[str, Any]) -> None:
        for flag in ("amsgrad", "maximize", "differentiable", "capturable"):
            if group.get(flag):
                raise ValueError(f"offload_optimizer does not support {flag}=True in the optimizer")

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor], states: dict[str, list[torch.Tensor]],
             step: torch.Tensor, group: dict[str, Any]) -> None:
        """One update of every piece; ``step`` is the count *after* this update (already incremented).

        Pieces of mixed dtypes (a bf16/fp16 master with fp32 state, DeepSpeedCPUAdam's
        ``fp32_optimizer_states``) are updated in fp32 and written back in their own dtypes."""
        dtypes = {t.dtype for t in [*params, *grads, *(t for v in states.values() for t in v)]}
        if len(dtypes) > 1:
            self._step_in_fp32(params, grads, states, step, group)
            return
        steps = [step] * len(params)
        if self.name == "adagrad":
            torch._fused_adagrad_(params, grads, states["sum"], steps, lr=float(group["lr"]),
                                  lr_decay=float(group.get("lr_decay", 0.0)),
                                  weight_decay=float(group.get("weight_decay", 0.0)), eps=float(group["eps"]),
                                  maximize=False)
            return
        beta1, beta2 = group["betas"]
        fn = torch._fused_adamw_ if self.name == "adamw" else torch._fused_adam_
        fn(params, grads, states["exp_avg"], states["exp_avg_sq"], [], steps, lr=float(group["lr"]),
           beta1=float(beta1), beta2=float(beta2), weight_decay=float(group.get("weight_decay", 0.0)),
           eps=float(group["eps"]), amsgrad=False, maximize=False)


    def _step_in_fp32(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                      states: dict[str, list[torch.Tensor]], step: torch.Tensor, group: dict[str, Any]) -> None:
        up = {k: [t.float() for t in v] for k, v in states.items()}
        p32 = [p.float() for p in params]
        self.step(p32, [g.float() for g in grads], up, step, group)
        for dst, src in zip([*params, *(t for v in states.values() for t in v)],
                            [*p32, *(t for v in up.values() for t in v)]):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)


ADAM = FlatKernel("adam", ("exp_avg", "exp_avg_sq"))
ADAMW = FlatKernel("adamw", ("exp_avg", "exp_avg_sq"))
ADAGRAD = FlatKernel("adagrad", ("sum",))


def kernel_for(optimizer: torch.optim.Optimizer) -> FlatKernel | None:
    """The flat kernel of ``optimizer``'s update rule, or None when it has none (SGD, Lamb, a custom one)."""
    if isinstance(optimizer, Lamb):
        return None
    if isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam with decoupled weight decay
        decoupled = isinstance(optimizer, torch.optim.AdamW) or optimizer.defaults.get("decoupled_weight_decay")
        return ADAMW if decoupled else ADAM
    if isinstance(optimizer, torch.optim.Adagrad):
        return ADAGRAD
    return None


@torch.no_grad()
def adam_step_flat(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   step: torch.Tensor, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                   eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True) -> None:
    """Adam(W) on one flat fp32 host tensor, in place; increments ``step`` (a 0-d float tensor) first."""
    step += 1
    (ADAMW if adamw_mode else ADAM).step([param], [grad], {"exp_avg": [exp_avg], "exp_avg_sq": [exp_avg_sq]},
                                         step, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
