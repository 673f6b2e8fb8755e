"""Parallelisms as data: how this rank's gradient squares add up to the one global gradient norm.

Every element of the model's gradient lives on one or more ranks. The global norm counts each element once,
so each rank contributes only what it *owns* and one sum over the union of the axes (the world, or the
data-parallel group alone) finishes it:

- a ZeRO-partitioned group: each rank owns its shard; an unpartitioned one is owned by rank 0 of its shard
  group (the data-parallel group, or an expert set's expert-data-parallel group);
- tensor parallelism: a split parameter's slices are all owned; a replicated one by tensor rank 0;
- pipeline parallelism: stages hold different layers; a tied weight is counted on one stage (``replicated``
  lists the copies that are skipped);
- expert parallelism: expert-parallel ranks hold different experts, all owned.

The overflow verdict is one MAX over the same union. Pipeline, tensor and expert parallelism describe
themselves here (``runtime/build_optimizer.py``) instead of subclassing the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import comm
from .sharded_group import ShardedGroup
from .squares import sum_of_squares


@dataclass(frozen=True)
class NormAxes:
    """The axes beyond data parallelism that the gradient norm and the overflow flag span."""

    shard_groups: tuple[Any, ...] | None = None  # per optimizer group: its partition group (None: data-parallel)
    split: frozenset[int] = frozenset()  # id(param) of params split over ``tp_group``
    tp_group: Any = None
    replicated: frozenset[int] = frozenset()  # id(param) of tied copies another pipeline stage counts
    pipe_group: Any = None
    multi_axis: bool = field(default=False)  # the union is the world, not the data-parallel group

    @staticmethod
    def of(shard_groups: list[Any] | None = None, split: set[int] | frozenset[int] = frozenset(), tp_group: Any = None,
           replicated: set[int] | frozenset[int] = frozenset(), pipe_group: Any = None) -> "NormAxes":
        multi = tp_group is not None or pipe_group is not None or shard_groups is not None
        return NormAxes(None if shard_groups is None else tuple(shard_groups), frozenset(split), tp_group,
                        frozenset(replicated), pipe_group, multi)

    def shard_group(self, gi: int, dp_group: Any) -> Any:
        """The group over which optimizer group ``gi`` is partitioned."""
        if self.shard_groups is None or self.shard_groups[gi] is None:
            return dp_group
        return self.shard_groups[gi]

    def union(self, dp_group: Any) -> Any:
        """The one group the norm and the overflow flag are reduced over."""
        return None if self.multi_axis else dp_group

    def owned_squares(self, groups: list[ShardedGroup], grads: list[torch.Tensor], dp_group: Any) -> torch.Tensor:
        """The sum of squares (float64) of the gradient elements this rank owns (each element owned by one rank)."""
        sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
        tp_lead = self.tp_group is None or comm.get_rank(self.tp_group) == 0
        for gi, (grp, g) in enumerate(zip(groups, grads)):
            if not self.owns_group(gi, grp, dp_group):
                continue
            if tp_lead and not self.replicated:  # no gradient-sized temporary
                sq += sum_of_squares(g)
                continue
            for i, p in enumerate(grp.params):  # each slot on its own, so every rank rounds the same way
                if id(p) not in self.replicated and (tp_lead or id(p) in self.split):
                    sq += sum_of_squares(grp.slot_view(g, i))
        return sq

    def owns_group(self, gi: int, grp: ShardedGroup, dp_group: Any) -> bool:
        """Partitioned: this rank holds its own shard (MiCS: the first of its replicas); otherwise rank 0 of the
        shard group speaks for it."""
        if grp.num_partitions > 1:
            replicas = getattr(grp, "replica_group", None)
            return replicas is None or comm.get_rank(replicas) == 0
        return comm.get_rank(self.shard_group(gi, dp_group)) == 0
