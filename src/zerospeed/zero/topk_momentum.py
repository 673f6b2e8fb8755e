"""Top-k momentum exchange (``gradient_compression.momentum_exchange``): 1-bit Adam's shape, top-k instead of signs.

After the dense warm-up of ``warmup_steps`` (Adam; then its variance frozen, ``optim/frozen_variance.py``)
the engine stops all-reducing gradients (stage 0: each rank keeps its local gradient ``g_r``) and, per
parameter group, as one flat vector::

    x_r = e_r + beta1 * m + (1 - beta1) * g_r     m: Adam's exp_avg (the same on every rank), e_r: this rank's error
    m   = (1 / world) * sum over ranks of the top-k of x_r     (k = ceil(ratio * n); e_r keeps what was not sent)
    p  -= lr * m / (sqrt(v / (1 - beta2^warmup_steps)) + eps)                          (v frozen at the warm-up)

The exchanged value is the error-compensated momentum, not the gradient: an entry once sent stays large in
``beta1 * m`` and keeps being sent while it decays, and error feedback keeps the sum of the delivered momenta
equal to the sum of the true ones. With ``union_indices`` the ranks all-gather their top-k indices and
all-reduce their values at the union (``comm.union_sparse_all_reduce``): every delivered entry is exact.

With ``local_variance`` the variance stays live instead: each rank updates Adam's ``exp_avg_sq`` from its own
local gradient and exchanges the error-compensated *preconditioned* momentum, which is the step itself::

    v_r = beta2 * v_r + (1 - beta2) * g_r^2
    x_r = e_r + beta1 * u + (1 - beta1) * g_r / (sqrt(v_r / (1 - beta2^t)) + eps)
    u   = (1 / world) * sum over ranks of the top-k of x_r   (kept in exp_avg);   p -= lr * u

(at the first compressed step ``u`` starts as Adam's own ``m / (sqrt(v_hat) + eps)``). ``exp_avg_sq`` then
differs between ranks; a checkpoint keeps one rank's.

The error buffers are per rank and are not checkpointed: like DeepSpeed's 1-bit error buffers they start
again from zero after a checkpoint load (detected as a replaced optimizer state) or a change of world size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import comm
from ..config.compression import GradientCompressionConfig
from ..config.errors import ConfigError


class TopkMomentumExchange:
    """Exchanges the error-compensated momentum of each group's flat local gradient (see the module doc)."""

    def __init__(self, ratio: float, union_indices: bool, dp_group: comm.Group | None,
                 local_variance: bool = False, warmup_steps: int = 0) -> None:
        self.ratio = ratio
        self.warmup_steps = warmup_steps  # dense (all-reduced) optimizer steps before the exchange starts
        self.union_indices = union_indices
        self.local_variance = local_variance
        self.dp_group = dp_group
        self.errors: dict[int, tuple[Any, torch.Tensor]] = {}  # group -> (the state it belongs to, e_r)

    def allreduce_gate(self, compressor: Any) -> Callable[[], bool]:
        """The reducer's ``allreduce_gate``: all-reduce gradients during the warm-up only (``compressor.steps``)."""
        return lambda: compressor.steps < self.warmup_steps

    def reset(self) -> None:
        self.errors.clear()

    def error(self, gi: int, owner: Any, like: torch.Tensor) -> torch.Tensor:
        """Group ``gi``'s error buffer; zeros when new or when ``owner`` (its optimizer state) was replaced."""
        held = self.errors.get(gi)
        if held is None or held[0] is not owner or held[1].numel() != like.numel():
            held = (owner, torch.zeros_like(like, dtype=torch.float32))
            self.errors[gi] = held
        return held[1]

    @torch.no_grad()
    def exchange_groups(self, optimizer: torch.optim.Optimizer, groups: list[Any], grads: list[torch.Tensor],
                        param_group: Callable[[Any], dict[str, Any]], frozen_at: int) -> None:
        """Replace each sharded group's flat local gradient by the exchanged momentum, reading Adam's state of
        its master parameters as flat vectors (``local_variance``: writing its variance back)."""
        for gi, (grp, grad) in enumerate(zip(groups, grads)):
            flat = {"exp_avg": torch.zeros_like(grad)}
            if self.local_variance:
                flat["exp_avg_sq"] = torch.zeros_like(grad)
            for i, mp in enumerate(grp.master_params):
                st = optimizer.state.get(mp)
                for key, out in flat.items():
                    if st and key in st:
                        view = grp.slot_view(out, i)
                        view.copy_(st[key].reshape(view.shape))
            owner = optimizer.state.get(grp.master_params[0])
            pg = param_group(grp)
            beta2, eps, t = pg["betas"][1], pg["eps"], int(owner["step"]) + 1 if owner else 1
            momentum, variance = flat["exp_avg"], flat.get("exp_avg_sq")
            if variance is not None and t - 1 == frozen_at:  # exp_avg is still Adam's m: start from Adam's step
                momentum.div_((variance / (1 - beta2 ** max(1, t - 1))).sqrt().add_(eps))
            self.exchange(gi, grad, momentum, float(pg["betas"][0]), owner, variance, beta2, eps, t)
            for i, mp in enumerate(grp.master_params if variance is not None else []):
                st = optimizer.state.get(mp)
                if st and "exp_avg_sq" in st:
                    st["exp_avg_sq"].copy_(grp.slot_view(variance, i).reshape(st["exp_avg_sq"].shape))

    @torch.no_grad()
    def exchange(self, gi: int, grad: torch.Tensor, momentum: torch.Tensor, beta1: float, owner: Any,
                 variance: torch.Tensor | None = None, beta2: float = 0.0, eps: float = 0.0, t: int = 1) -> None:
        """Replace the flat local gradient ``grad`` by the exchanged momentum; ``momentum`` (Adam's exp_avg of
        the group, flat) is used up as scratch. With ``variance`` (``local_variance``: this rank's exp_avg_sq,
        flat, updated here; ``t`` its step count) the gradient is preconditioned first and ``momentum`` is
        the shared update."""
        local = grad
        if variance is not None:
            variance.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            local = grad / (variance / (1 - beta2 ** t)).sqrt_().add_(eps)
        x = momentum.mul_(beta1).add_(local, alpha=1 - beta1)
        err = self.error(gi, owner, x)
        if self.union_indices:
            comm.union_sparse_all_reduce(x, self.ratio, err, self.dp_group)
        else:
            comm.sparse_all_reduce(x, self.ratio, err, self.dp_group)
        grad.copy_(x).mul_(1.0 / comm.get_world_size(self.dp_group))


def momentum_exchange_for(section: GradientCompressionConfig, partitioned: bool, clip: float, moe: bool,
                          dp_group: comm.Group | None) -> TopkMomentumExchange | None:
    """With ``gradient_compression.momentum_exchange`` on (``section``), the exchange the ZeRO optimizer is built
    with (its reducer keeps local gradients once the warm-up is over: ``allreduce_gate``); refuse what it cannot
    serve (names the key)."""
    if section.type != "topk" or not section.momentum_exchange:
        return None
    key = "gradient_compression.momentum_exchange"
    if partitioned:
        raise ConfigError(key, "works with ZeRO stage 0 only (each rank keeps its whole local gradient)")
    if clip > 0:
        raise ConfigError(key, "does not work with gradient_clipping (the ranks' local gradient norms differ): "
                          "set gradient_clipping to 0")
    if moe:
        raise ConfigError(key, "does not work with Mixture-of-Experts layers")
    return TopkMomentumExchange(section.ratio, section.union_indices, dp_group, section.local_variance,
                                section.warmup_steps)
