"""Muon (MomentUm Orthogonalized by Newton-Schulz) and DeepSpeed's ``MuonWithAuxAdam``.

Per matrix ``W`` with gradient ``g`` (DeepSpeed's ``muon_update``)::

    m <- lerp(m, g, 1 - momentum)                 # momentum buffer (kept when g is not finite)
    u <- lerp(g, m, momentum) if nesterov else m  # Nesterov blend
    o <- NS(u) * sqrt(max(1, rows / cols))        # newton_schulz.orthogonalize
    W <- W * (1 - lr * weight_decay) - lr * o

The auxiliary Adam (groups with ``use_muon = False``: embeddings, heads, biases, norms) is DeepSpeed's:
bias-corrected ``m_hat / (sqrt(v_hat) + eps)``, decoupled weight decay unless ``adam_w_mode`` is false (then
L2: ``g + weight_decay * W``). Defaults are DeepSpeed's: Muon ``lr 0.02, momentum 0.95, weight_decay 0,
ns_method "gram"``; Adam ``lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight_decay 0``.

Everything but the Newton-Schulz step is element-wise, so under ZeRO the optimizer runs on each rank's
flat shards and hands the blended updates ``u`` of sharded matrices to ``shard_orthogonalizer`` (set by the
ZeRO optimizer, ``zero/muon_exchange.py``), which returns this rank's shard of ``NS(u) * scale``.
State is torch's layout (``momentum_buffer``; ``exp_avg``, ``exp_avg_sq``, 0-d ``step``), so
``state_dict``/``load_state_dict`` are torch.optim's and checkpoints reshard it like any element-wise state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from .newton_schulz import NS_METHODS, orthogonalize

MUON_DEFAULTS: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram",
                                 "nesterov": True}
ADAM_DEFAULTS: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


class ShardOrthogonalizer(Protocol):
    """Orthogonalises updates of parameters held as flat shards of a larger matrix (collective)."""

    def holds(self, param: torch.Tensor) -> bool: ...

    def __call__(self, items: list[tuple[torch.Tensor, torch.Tensor, str]]) -> list[torch.Tensor]: ...


def _check_muon_group(group: dict[str, Any]) -> None:
    if group["ns_method"] not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"Muon momentum must be in [0, 1), got {group['momentum']}")
    if group["lr"] < 0 or group["weight_decay"] < 0:
        raise ValueError(f"Muon lr and weight_decay must be >= 0, got {group['lr']} and {group['weight_decay']}")


def _blend(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
    """Update the momentum buffer from ``p.grad`` and return the (Nesterov) blended update ``u``."""
    grad = p.grad if p.grad is not None else torch.zeros_like(p)  # as DeepSpeed: no gradient is a zero one
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p)
    buf, beta = state["momentum_buffer"], group["momentum"]
    finite = torch.isfinite(grad).all()  # an overflowed gradient leaves the momentum as it was (DeepSpeed)
    buf.copy_(torch.where(finite, buf.lerp(grad, 1 - beta), buf))
    return grad.lerp(buf, beta) if group["nesterov"] else buf.clone()


class _MuonSteps(torch.optim.Optimizer):
    """The Muon half of a step, shared by :class:`Muon` and :class:`MuonWithAuxAdam`."""

    # Set by the ZeRO optimizer when the parameters are flat shards (zero/muon_exchange.py).
    shard_orthogonalizer: ShardOrthogonalizer | None = None

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        pending: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = []
        for group in groups:
            for p in group["params"]:
                pending.append((p, _blend(p, self.state[p], group), group))
        orth = self.shard_orthogonalizer
        sharded = [i for i, (p, _, _) in enumerate(pending) if orth is not None and orth.holds(p)]
        results: dict[int, torch.Tensor] = {}
        if sharded:
            assert orth is not None
            outs = orth([(pending[i][0], pending[i][1], pending[i][2]["ns_method"]) for i in sharded])
            results = dict(zip(sharded, outs))
        for i, (p, u, group) in enumerate(pending):
            update = results[i] if i in results else orthogonalize(u, group["ns_method"])
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update.reshape(p.shape), alpha=-group["lr"])


class Muon(_MuonSteps):
    """Muon on every parameter given (all matrices; DeepSpeed's ``SingleDeviceMuon`` signature plus
    ``nesterov``). For a whole model use :class:`MuonWithAuxAdam`."""

    def __init__(self, params: Iterable[Any], lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 ns_method: str = "gram", nesterov: bool = True) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_method=ns_method, nesterov=nesterov)
        _check_muon_group(defaults)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step(self.param_groups)
        return loss


class MuonWithAuxAdam(_MuonSteps):
    """DeepSpeed's ``MuonWithAuxAdam``: groups with ``use_muon=True`` are updated by Muon, the others by Adam.

    Every group must say ``use_muon``; missing settings take the defaults of its half (``MUON_DEFAULTS`` /
    ``ADAM_DEFAULTS``). ``adam_w_mode`` (default true) selects decoupled weight decay for the Adam half.
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]], adam_w_mode: bool = True) -> None:
        groups = []
        for i, group in enumerate(param_groups):
            if not isinstance(group, dict) or "use_muon" not in group:
                raise ValueError(f"parameter group {i} has no 'use_muon' entry: MuonWithAuxAdam needs every group "
                                 "to say whether Muon (matrices) or the auxiliary Adam updates it")
            group = dict(group)
            for k, v in (MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS).items():
                group.setdefault(k, v)
            if group["use_muon"]:
                _check_muon_group(group)
            else:
                group["betas"] = tuple(group["betas"])
            groups.append(group)
        self.adam_w_mode = adam_w_mode
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step([g for g in self.param_groups if g["use_muon"]])
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adam_group(group)
        return loss

    def _adam_group(self, group: dict[str, Any]) -> None:
        b1, b2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if not self.adam_w_mode and wd != 0:
                grad = grad.add(p, alpha=wd)
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = float(state["step"])
            state["exp_avg"].lerp_(grad, 1 - b1)
            state["exp_avg_sq"].lerp_(grad.square(), 1 - b2)
            m_hat = state["exp_avg"] / (1 - b1 ** step)
            v_hat = state["exp_avg_sq"] / (1 - b2 ** step)
            if self.adam_w_mode:
                p.mul_(1 - lr * wd)
            p.add_(m_hat / (v_hat.sqrt() + eps), alpha=-lr)


# DeepSpeed's names (``deepspeed.runtime.zero.muon.original_muon``): its distributed and single-device classes
# compute the same update; zerospeed's engine distributes the work itself (zero/muon_exchange.py).
SingleDeviceMuon = Muon
SingleDeviceMuonWithAuxAdam = MuonWithAuxAdam

__all__ = ["ADAM_DEFAULTS", "MUON_DEFAULTS", "Muon", "MuonWithAuxAdam", "SingleDeviceMuon",
           "SingleDeviceMuonWithAuxAdam"]
