"""Top-k routing of tokens to experts (GShard / Switch), with DeepSpeed's exact formulas.

A router turns gate logits ``[s tokens, e experts]`` into a :class:`Routing`: for each of the ``k`` routes
of each token, the chosen expert, the slot in that expert's buffer of ``capacity`` slots, and the weight
of the expert's output in the token's result. A route that did not fit is marked ``expert == -1``::

    capacity  = max(ceil(s / e * capacity_factor * k), min_capacity)      (drop_tokens=True)
              = max over the expert-parallel group of max(exp_counts)      (drop_tokens=False)
    l_aux     = sum(me * ce) * e                 (k=1)     me = mean softmax per expert
              = mean(me * ce) * e * e            (k=2)     ce = mean first-choice one-hot per expert
              = mean(me * ce) * e * e / k        (k>2)     (ce over all k choices)
    exp_counts: tokens per expert before any dropping (k=1: used tokens only)

``top1gating``/``top2gating``/``topkgating`` return DeepSpeed's dense view ``(l_aux, combine_weights [s,e,c],
dispatch_mask, exp_counts)``; ``route_top1``/``route_top2``/``route_topk`` return the sparse :class:`Routing` the
MoE layer dispatches with. Both come from one computation. Pure functions: the only communication is the
capacity maximum for ``drop_tokens=False`` over an explicitly passed expert-parallel group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import comm


@dataclass
class Routing:
    """Sparse routes: ``expert``/``location``/``gate`` are ``[k, s]``; ``expert == -1`` marks a dropped route."""

    l_aux: Tensor
    capacity: int
    num_experts: int
    expert: Tensor
    location: Tensor
    gate: Tensor
    exp_counts: Tensor

    def dense(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """DeepSpeed's ``(l_aux, combine_weights [s, e, c], dispatch_mask, exp_counts)``."""
        k, s = self.expert.shape
        combine = self.gate.new_zeros(s, self.num_experts, self.capacity)
        kept = self.expert >= 0
        tokens = torch.arange(s, device=self.expert.device).expand(k, s)
        combine.index_put_((tokens[kept], self.expert[kept], self.location[kept]), self.gate[kept], accumulate=True)
        return self.l_aux, combine, combine.bool(), self.exp_counts


def capacity_for(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's ``_capacity``: ``max(ceil(s / e * capacity_factor), min_capacity)`` (factor already times k)."""
    return max(int(math.ceil((num_tokens / num_experts) * capacity_factor)), int(min_capacity))


def _no_drop_capacity(exp_counts: Tensor, ep_group: Any) -> int:
    """drop_tokens=False: room for the busiest expert on any rank of the expert-parallel group."""
    top = exp_counts.max().reshape(1).to(torch.int64) if exp_counts.numel() else torch.zeros(1, dtype=torch.int64)
    if ep_group is not None and comm.is_initialized() and comm.get_world_size(ep_group) > 1:
        top = top.to(comm.device_for_backend(ep_group))
        comm.all_reduce(top, group=ep_group, op=comm.ReduceOp.MAX)
    return int(top.item())


def gumbel_noise(shape: torch.Size, device: torch.device) -> Tensor:
    """Standard Gumbel samples, drawn as DeepSpeed draws them (same RNG stream)."""
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def multiplicative_jitter(x: Tensor, epsilon: float = 1e-2) -> Tensor:
    """Multiply by U(1 - epsilon, 1 + epsilon) (Switch Transformer's input jitter, DeepSpeed's 'Jitter')."""
    if epsilon == 0:
        return x
    lo = torch.tensor(1.0 - epsilon, device=x.device)
    hi = torch.tensor(1.0 + epsilon, device=x.device)
    return x * torch.distributions.uniform.Uniform(lo, hi).rsample(x.shape)


def route_top1(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Any = None) -> Routing:
    """Switch routing: each token to its best expert; over capacity, keep random (``use_rts``) or first tokens."""
    gates = F.softmax(logits, dim=1)
    s, e = gates.shape
    capacity = capacity_for(s, e, capacity_factor, min_capacity)
    choose_from = logits + gumbel_noise(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    idx = torch.argmax(choose_from, dim=1)
    mask = F.one_hot(idx, num_classes=e)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        capacity = min(_no_drop_capacity(exp_counts, ep_group), s)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * e
    if use_rts:
        lo, hi = torch.tensor(0.0, device=logits.device), torch.tensor(1.0, device=logits.device)
        ranked = mask * torch.distributions.uniform.Uniform(lo, hi).rsample(mask.shape)
    else:
        ranked = mask
    keep = torch.topk(ranked, k=min(capacity, s), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    location = ((torch.cumsum(mask, dim=0) - 1) * mask).sum(dim=1)
    kept = mask.sum(dim=1) > 0
    gate = (gates * mask.float()).sum(dim=1)
    expert = torch.where(kept, idx, torch.full_like(idx, -1))
    return Routing(l_aux, capacity, e, expert.unsqueeze(0), location.unsqueeze(0), gate.unsqueeze(0), exp_counts)


def route_top2(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, top2_2nd_expert_sampling: bool = True) -> Routing:
    """GShard routing: best expert, then a second (Gumbel-sampled unless disabled) queued after all firsts."""
    gates = F.softmax(logits, dim=1)
    s, e = gates.shape
    idx1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(idx1, num_classes=e)
    second = logits + gumbel_noise(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    idx2 = torch.argmax(second.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(idx2, num_classes=e)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # second choices queue after firsts
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * e * e
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(s, e, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (loc1 < capacity)
        mask2 = mask2 * (loc2 < capacity)
    else:
        capacity = _no_drop_capacity(exp_counts, ep_group)
    g1 = (gates * mask1.float()).sum(dim=1)
    g2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    kept1, kept2 = mask1.any(dim=1), mask2.any(dim=1)
    expert = torch.stack([torch.where(kept1, idx1, -1), torch.where(kept2, idx2, -1)])
    location = torch.stack([(loc1 * mask1).sum(dim=1), (loc2 * mask2).sum(dim=1)])
    return Routing(l_aux, capacity, e, expert, location, torch.stack([g1 / denom, g2 / denom]), exp_counts)


def route_topk(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, drop_policy: str = "probs") -> Routing:
    """Top-k routing; over capacity an expert keeps its highest-probability (``probs``) or earliest tokens."""
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"Invalid drop_policy: {drop_policy!r} (expected 'probs' or 'position')")
    gates = F.softmax(logits, dim=1)
    s, e = gates.shape
    if not 1 <= k <= e:
        raise ValueError(f"top-k gating needs 1 <= k <= num_experts, got k={k} with {e} experts")
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * e * e / k
    if drop_tokens:
        capacity = capacity_for(s, e, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            ranked = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            keep = torch.topk(ranked, k=min(capacity, s), dim=0, sorted=False)[1]
            mask = mask & torch.zeros_like(mask).scatter_(0, keep, True)
            locations = torch.cumsum(mask, dim=0) - 1
        else:
            locations = torch.cumsum(mask, dim=0) - 1
            mask = mask & (locations < capacity)
    else:
        capacity = _no_drop_capacity(exp_counts, ep_group)
        locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    kept = mask.gather(1, top_idx)
    expert = torch.where(kept, top_idx, -1).t().contiguous()
    location = (locations.gather(1, top_idx) * kept).t().contiguous()
    return Routing(l_aux, capacity, e, expert, location, masked.gather(1, top_idx).t().contiguous(), exp_counts)


# --- DeepSpeed's public functions (dense view) -------------------------------------------------------------

def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Any = None, use_tutel: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DeepSpeed's ``top1gating``: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
    if use_tutel:
        raise NotImplementedError("use_tutel (Tutel kernels) is not supported yet by zerospeed")
    return route_top1(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens, use_rts,
                      ep_group).dense()


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, top2_2nd_expert_sampling: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DeepSpeed's ``top2gating``: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
    return route_top2(logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling).dense()


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, drop_policy: str = "probs") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DeepSpeed's ``topkgating``: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
    return route_topk(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy).dense()
