"""AutoEP's experts: an HF MoE block's experts module, replaced by grouped weights spread over expert-parallel ranks.

The HF block keeps its router and its own forward (jitter, top-k, normalisation, shared experts, and the
router logits HF's load-balancing loss reads), so the model's semantics are unchanged; only the call
``experts(hidden [S, H], top_k_index [S, k], top_k_weights [S, k])`` runs here. Expert-parallel rank ``p``
of ``P`` holds global experts ``[p E/P, (p+1) E/P)`` as slices of the HF tensors (the same Parameter objects,
cut in place). One forward::

    routes sorted by expert  --all-to-all (rows per destination rank)-->  rows of my experts, by source rank
      --regroup expert-major--> one grouped matmul per weight --back--> weighted sum into each token

No capacity, no dropped tokens (HF's MoE is dropless). The two all-to-alls are the MoE layer's
differentiable uneven ``dispatch.all_to_all``; the per-(source, expert) row counts are agreed first with
one small all-gather. In a checkpoint each slice is addressed inside the full HF tensor (``ExpertSlice``),
so a checkpoint saved at one ``autoep_size`` loads at any other, optimizer state included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .... import comm
from ..dispatch import all_to_all
from ..experts import mark_expert_params
from ..groups import ExpertGroups, create_expert_groups, group_name
from .detect import MoEBlockSpec
from .folding import TensorFold
from .grouped import expert_mlp
from .routing import RouteAdjust


@dataclass(frozen=True)
class ExpertSlice:
    """Where a rank's grouped weight sits in the full HF tensor: element ``offset`` of ``shape`` (flattened)."""

    offset: int
    shape: torch.Size


def expert_slice(t: Any) -> ExpertSlice | None:
    """The ``ExpertSlice`` of an AutoEP expert weight (None for any other tensor)."""
    return getattr(t, "expert_slice", None)


class AutoEPExperts(nn.Module):
    """Grouped expert weights of one MoE block; the interface ``MoETraining`` reads (like ``MoE``'s)."""

    enable_expert_tensor_parallelism = False
    autoep = True
    expert_tp = None

    def __init__(self, experts: nn.Module, spec: MoEBlockSpec, ep_size: int, use_grouped_mm: bool = True,
                 routing: RouteAdjust | None = None, validate_fold: bool = False) -> None:
        super().__init__()
        self.routing = routing or RouteAdjust()
        self.validate_fold = validate_fold  # validate_folding_routing: compare the tensor ranks' routes
        self.spec = spec
        self.ep_size = ep_size
        self.num_experts = spec.num_experts
        self.num_local_experts = spec.num_experts // ep_size
        self.expert_group_name = group_name(ep_size)
        self.use_grouped_mm = use_grouped_mm
        self.act_fn = experts.act_fn
        self.weight_names = [n for n in (spec.w1, spec.w2, spec.w3) if n is not None]
        for n in self.weight_names:  # the same Parameter objects: names, client optimizers stay valid
            self.register_parameter(n, getattr(experts, n))
        mark_expert_params(self, self.expert_group_name)
        self.expert_groups: ExpertGroups | None = None
        self.ep_group: Any = None
        self.fold: TensorFold | None = None

    def expert_parameters(self) -> list[nn.Parameter]:
        return [getattr(self, n) for n in self.weight_names]

    @torch.no_grad()
    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False,
                                  registry: dict[str, ExpertGroups] | None = None, mpu: Any = None) -> None:
        """Create (or reuse) the expert groups and keep only this rank's experts. Collective over the world."""
        self.expert_groups = create_expert_groups(self.ep_size, use_data_before_expert_parallel_, registry, mpu)
        self.ep_group = self.expert_groups.ep_group
        lo = self.expert_groups.ep_rank * self.num_local_experts
        if self.num_local_experts < self.num_experts and not all(p.requires_grad for p in self.expert_parameters()):
            raise NotImplementedError(f"frozen AutoEP experts ({self.spec.name}) spread over expert-parallel ranks are "
                                      "not supported yet by zerospeed (their checkpoint slices); train them, or use "
                                      "expert_parallel.autoep_size 1")
        for p in self.expert_parameters():
            full = expert_slice(p).shape if expert_slice(p) is not None else p.shape
            if p.shape[0] == self.num_experts:  # not cut yet
                p.data = p.data[lo:lo + self.num_local_experts].clone()
            p.expert_slice = ExpertSlice(lo * full[1:].numel(), torch.Size(full))  # type: ignore[attr-defined]

    def global_expert_ids(self) -> list[int]:
        p = self.expert_groups.ep_rank if self.expert_groups is not None else 0
        return list(range(p * self.num_local_experts, (p + 1) * self.num_local_experts))

    def _weights(self) -> tuple[Tensor, Tensor, Tensor | None]:
        s = self.spec
        return getattr(self, s.w1), getattr(self, s.w2), getattr(self, s.w3) if s.w3 is not None else None

    def _local(self, x: Tensor, counts: list[int]) -> Tensor:
        w1, w2, w3 = self._weights()
        return expert_mlp(x, counts, w1, w2, w3, self.act_fn, self.use_grouped_mm)

    def fold_tensor_parallel(self, fold: TensorFold | None) -> None:
        """Parallel folding (``folding.py``): the tensor group's ranks each compute a share of the routes."""
        self.fold = fold

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        s, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        weights = self.routing.weights(top_k_weights).reshape(-1).index_select(0, order)      # by expert
        if self.fold is None:
            rows = hidden_states.index_select(0, token)                               # [S k, H], by expert
            out = self._compute(self._pre(rows, weights), torch.bincount(flat, minlength=self.num_experts))
        else:  # this tensor rank's share of the routes, then every share's outputs
            if self.validate_fold:
                self.fold.check_same_routes(top_k_index, self.spec.name)
            experts = flat.index_select(0, order)
            shares = self.fold.shares(experts)
            mine = shares[self.fold.rank]
            rows = self.fold.copy_in(hidden_states).index_select(0, token.index_select(0, mine))
            if self.routing.pre:
                rows = self._pre(rows, self.fold.copy_in(weights).index_select(0, mine))
            counts = torch.bincount(experts.index_select(0, mine), minlength=self.num_experts)
            out = self.fold.gather_out(self._compute(rows, counts), shares)
        weighted = out if self.routing.pre else out * weights.unsqueeze(-1).to(out.dtype)
        return hidden_states.new_zeros(hidden_states.shape).index_add_(0, token, weighted.to(hidden_states.dtype))

    def _pre(self, rows: Tensor, weights: Tensor) -> Tensor:
        """``score_apply: "pre"``: each routed token times its weight before the experts (DeepSpeed's formula)."""
        return (rows.float() * weights.unsqueeze(-1)).to(rows.dtype) if self.routing.pre else rows

    def _compute(self, rows: Tensor, counts: Tensor) -> Tensor:
        if self.num_local_experts == self.num_experts:  # every expert here: no exchange
            return self._local(rows, counts.tolist())
        if self.expert_groups is None:
            raise RuntimeError("AutoEP experts spread over expert-parallel ranks have no expert-parallel group: "
                               "pass the model to zerospeed.initialize()")
        return self._exchange(rows, counts)

    def _exchange(self, rows: Tensor, counts: Tensor) -> Tensor:
        """Rows sorted by global expert -> their expert outputs, computed on the ranks that hold the experts."""
        ep, local = self.ep_size, self.num_local_experts
        me = self.expert_groups.ep_rank if self.expert_groups is not None else 0
        mine = counts.to(torch.int64).to(comm.device_for_backend(self.ep_group))
        every = torch.empty(ep * self.num_experts, dtype=torch.int64, device=mine.device)
        comm.all_gather(every, mine, group=self.ep_group)
        table = every.view(ep, ep, local).cpu()                   # [source rank, destination rank, local expert]
        send = table[me].sum(1).tolist()                          # rows I send to each rank
        recv = table[:, me].sum(1).tolist()                       # rows each rank sends me
        got = all_to_all(self.ep_group, rows, recv, send)         # source-major, then local expert
        perm = _expert_major(table[:, me]).to(rows.device)
        out = self._local(got.index_select(0, perm), table[:, me].sum(0).tolist())
        back = out.index_select(0, torch.argsort(perm))
        return all_to_all(self.ep_group, back, send, recv)


def _expert_major(c: Tensor) -> Tensor:
    """Row order that turns source-major blocks (``c[i, e]`` rows of source i, expert e) into expert-major."""
    start = torch.cat([c.new_zeros(1), c.reshape(-1).cumsum(0)[:-1]]).view_as(c)
    idx = [torch.arange(int(start[i, e]), int(start[i, e] + c[i, e])) for e in range(c.shape[1])
           for i in range(c.shape[0])]
    return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
