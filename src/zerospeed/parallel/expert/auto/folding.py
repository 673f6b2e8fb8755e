"""Parallel folding: the ranks of a tensor-parallel group (AutoTP's attention) also serve as expert-parallel ranks.

The ``tp`` ranks of a tensor-parallel group hold the same tokens and, after the attention's row-parallel
all-reduce, the same hidden states, so they route identically. Each of them takes one ``1/tp`` share of the
routes (DeepSpeed's rule: the route of per-expert ordinal ``j`` goes to tensor rank ``j % tp``), so a route is
computed once in the world; the shares travel with the expert-parallel all-to-all, and the outputs are
gathered back over the tensor group into the full route list, identical on every tensor rank::

    hidden [S, H] --copy_to_tp (backward: sum over tp)--> my routes' rows --a2a / experts / a2a--> my outputs
      --gather_from_tp (backward: my rows' gradient)--> every route's output --> weighted sum (HF's top-k weights)

Everything after the gather (the weighting by the router's probabilities, the residual stream, the loss) is
computed identically on every tensor rank, so the router and the dense replicated parameters get their full
gradient on every rank and nothing needs correcting; the hidden states' gradient is the sum of the tensor ranks'
shares (Megatron's "copy to the tensor region"). DeepSpeed's fold instead all-reduces in the gather's backward,
which leaves ``tp`` times the gradient on the router and the experts and divides it out again in the optimizer.

An expert's gradient is the sum over its routes, each computed once, so over the expert-data-parallel group it
sums the ``world / tp`` data replicas' gradients: ``MoETraining`` scales it by ``tp / ep`` (instead of ``1 / ep``
unfolded) before that group's average.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .... import comm
from ...tensor.mappings import copy_to_tensor_model_parallel_region


def share_of_routes(sorted_experts: Tensor, tp_size: int, tp_rank: int) -> Tensor:
    """Positions (in the expert-sorted route list) of this tensor rank's share: per-expert ordinal ``% tp``; pure."""
    n = sorted_experts.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=sorted_experts.device)
    pos = torch.arange(n, device=sorted_experts.device)
    new = torch.ones(n, dtype=torch.bool, device=sorted_experts.device)
    new[1:] = sorted_experts[1:] != sorted_experts[:-1]
    start = torch.cummax(torch.where(new, pos, torch.zeros_like(pos)), dim=0).values
    return torch.nonzero((pos - start) % tp_size == tp_rank).flatten()


class _GatherShares(torch.autograd.Function):
    """Every tensor rank's share of rows, placed back at its positions; backward: this rank's rows."""

    @staticmethod
    def forward(ctx: Any, mine: Tensor, group: Any, positions: list[Tensor], me: int) -> Tensor:  # type: ignore[override]
        ctx.position = positions[me]
        width = max(len(p) for p in positions)
        padded = mine.new_zeros((width, *mine.shape[1:]))
        padded[:mine.shape[0]] = mine
        every = mine.new_empty((len(positions) * width, *mine.shape[1:]))
        comm.all_gather(every, padded, group=group)
        full = mine.new_empty((sum(len(p) for p in positions), *mine.shape[1:]))
        for r, p in enumerate(positions):
            full[p.to(full.device)] = every[r * width:r * width + len(p)]
        return full

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return grad.index_select(0, ctx.position.to(grad.device)), None, None, None


class TensorFold:
    """The tensor group one AutoEP layer folds over: which routes this rank computes, and the two crossings."""

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def check_same_routes(self, top_k_index: Tensor, layer: str) -> None:
        """``validate_folding_routing``: every tensor rank must have routed the same tokens to the same experts
        (a digest compared over the group; every rank raises together, so none waits)."""
        idx = top_k_index.reshape(-1).to(torch.int64)
        weights = torch.arange(1, idx.numel() + 1, dtype=torch.int64, device=idx.device)
        mine = torch.stack([torch.tensor(idx.numel(), device=idx.device), (idx * weights).sum() % 2147483647])
        mine = mine.to(comm.device_for_backend(self.group))
        every = torch.empty(self.size * 2, dtype=torch.int64, device=mine.device)
        comm.all_gather(every, mine, group=self.group)
        digests = every.view(self.size, 2).tolist()
        if any(d != digests[0] for d in digests):
            raise RuntimeError(f"AutoEP folding ({layer}): the tensor-parallel ranks routed differently (route "
                               f"digests {digests}, by tensor rank); they must see the same tokens (one data-parallel "
                               "replica per tensor group) and the same router weights")

    def shares(self, sorted_experts: Tensor) -> list[Tensor]:
        return [share_of_routes(sorted_experts, self.size, r) for r in range(self.size)]

    def copy_in(self, hidden: Tensor) -> Tensor:
        return copy_to_tensor_model_parallel_region(hidden, self.group)

    def gather_out(self, mine: Tensor, shares: list[Tensor]) -> Tensor:
        return _GatherShares.apply(mine, self.group, shares, self.rank)
