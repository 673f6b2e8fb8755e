"""Mixture of Experts with expert parallelism: routing (pure), the MoE layer, expert groups on the topology.

Served under DeepSpeed's paths ``zerospeed.moe.layer`` (MoE), ``zerospeed.moe.sharded_moe`` (TopKGate,
MOELayer, top1gating, top2gating, topkgating), ``zerospeed.moe.experts`` and ``zerospeed.moe.utils``.
"""

from .experts import Experts
from .gate import TopKGate
from .gating import (Routing, capacity_for, gumbel_noise, multiplicative_jitter, route_top1, route_top2, route_topk,
                     top1gating, top2gating, topkgating)
from .groups import ExpertGroups, create_expert_groups, expert_rank_lists, expert_topology, group_name
from .layer import MoE, MOELayer
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

gumbel_rsample = gumbel_noise  # DeepSpeed's name (takes shape, device)

__all__ = ["ColumnParallelLinear", "ExpertGroups", "Experts", "RowParallelLinear", "expert_rank_lists", "MOELayer", "MoE", "Routing", "TopKGate", "capacity_for", "create_expert_groups",
           "expert_topology", "group_name", "gumbel_noise", "gumbel_rsample", "multiplicative_jitter", "route_top1",
           "route_top2", "route_topk", "top1gating", "top2gating", "topkgating"]
