"""TopKGate: the learned router (a bias-free linear layer in fp32) in front of the routing functions."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .gating import Routing, multiplicative_jitter, route_top1, route_top2, route_topk

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


class _Fp32Linear(nn.Linear):
    """The router's linear layer, applied in fp32 whatever the model's dtype (as DeepSpeed does); called
    as a module, so ZeRO-3 gathers its weight around the call."""

    def forward(self, input: Tensor) -> Tensor:
        return torch.nn.functional.linear(input.float(), self.weight.float())


class TopKGate(nn.Module):
    """DeepSpeed's ``TopKGate(model_dim, num_experts, k, ...)``.

    ``forward(input)`` returns DeepSpeed's dense ``(l_aux, combine_weights, dispatch_mask, exp_counts)``;
    :meth:`route` returns the sparse :class:`Routing` the MoE layer uses. Noise ('Jitter' on the input,
    'RSample' on top-1 logits) and ``capacity_factor`` apply in training; evaluation uses
    ``eval_capacity_factor`` and no noise.
    """

    wg: nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"Unsupported noisy_gate_policy: {noisy_gate_policy!r} (use None, 'Jitter' or 'RSample')")
        if not 1 <= k <= num_experts:
            raise ValueError(f"TopKGate: k={k} must be between 1 and num_experts={num_experts}")
        self.wg = _Fp32Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.drop_policy = "probs"

    def _set_ep_group(self, ep_group: Any) -> None:
        if self.ep_group is not None:
            raise ValueError("TopKGate: the expert-parallel group is already set")
        self.ep_group = ep_group

    def route(self, input: Tensor, used_token: Tensor | None = None) -> Routing:
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = self.wg(x)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            noise = self.noisy_gate_policy if self.training else None
            return route_top1(logits, factor, self.min_capacity, used_token, noise, self.drop_tokens, self.use_rts,
                              self.ep_group)
        if used_token is not None:
            raise ValueError("used_token is only supported with k=1 (as in DeepSpeed)")
        if self.k == 2:
            return route_top2(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling)
        return route_topk(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group, self.drop_policy)

    def forward(self, input: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.route(input, used_token).dense()
