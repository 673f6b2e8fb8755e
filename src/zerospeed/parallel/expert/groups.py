"""Expert-parallel and expert-data-parallel groups, laid out as DeepSpeed lays them, on the shared topology.

With ``ep_size`` experts-parallel ranks in a data-parallel world of ``W`` ranks, the grid is
``ProcessTopology(axes=['expert_data', 'expert'], dims=[W // ep, ep])`` (DeepSpeed's "E + D" order: expert
peers adjacent). For W = 8, ep = 2::

    expert-parallel groups       [0,1] [2,3] [4,5] [6,7]     all-to-all of tokens; each holds all experts
    expert-data-parallel groups  [0,2,4,6] [1,3,5,7]         gradients of expert params are reduced here
    data-parallel group          [0..7]                      gradients of dense params are reduced here

``use_data_before_expert_parallel_`` swaps the axes ("D + E": expert-data peers adjacent, expert peers
``W // ep`` apart). Groups are created once per ``ep_size`` and kept in a registry dict that the caller
owns (the engine passes one to every MoE layer), never in module globals.

With pipeline (or tensor) parallelism the same cut is made inside each data-parallel group of the grid
(DeepSpeed's ``_get_expert_parallel_ranks``): with stages ``[0,1] [2,3]`` (pp 2, dp 2) and ep 2 the expert
groups are ``[0,1]`` and ``[2,3]`` and every expert-data group has one rank; experts never span stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import comm
from ..topology import ProcessTopology


def group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert group of an ``ep_size`` (the ``group_name`` of expert params)."""
    return f"ep_size_{ep_size}"


def expert_topology(world_size: int, ep_size: int, data_before_expert: bool = False) -> ProcessTopology:
    """The (expert-data x expert) grid; pure."""
    if ep_size < 1 or world_size % ep_size:
        raise ValueError(f"expert-parallel size {ep_size} must divide the data-parallel world size {world_size}")
    if data_before_expert:
        return ProcessTopology(axes=["expert", "expert_data"], dims=[ep_size, world_size // ep_size])
    return ProcessTopology(axes=["expert_data", "expert"], dims=[world_size // ep_size, ep_size])


def expert_rank_lists(dp_lists: list[list[int]], ep_size: int,
                      data_before_expert: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel, expert-data-parallel) rank lists, cut inside each data-parallel group; pure.

    A data-parallel group ``[d0, d1, ...]`` of ``D`` ranks gives expert groups of ``ep`` consecutive members
    ("E + D") or of members ``D // ep`` apart ("D + E"), and expert-data groups joining the members at the
    same place in each expert group, as DeepSpeed's ``_get_expert_parallel_ranks`` does for its grid."""
    ep_lists: list[list[int]] = []
    edp_lists: list[list[int]] = []
    for dp in dp_lists:
        if ep_size < 1 or len(dp) % ep_size:
            raise ValueError(f"expert-parallel size {ep_size} must divide the data-parallel world size {len(dp)}")
        stride = len(dp) // ep_size
        if data_before_expert:
            parts = [[dp[s + j * stride] for j in range(ep_size)] for s in range(stride)]
        else:
            parts = [dp[i:i + ep_size] for i in range(0, len(dp), ep_size)]
        ep_lists += parts
        edp_lists += [list(ranks) for ranks in zip(*parts)]
    return ep_lists, edp_lists


@dataclass
class ExpertGroups:
    """This rank's expert-parallel (``ep``) and expert-data-parallel (``edp``) groups for one ``ep_size``."""

    name: str
    ep_size: int
    ep_ranks: list[int]
    edp_ranks: list[int]
    ep_group: Any
    edp_group: Any

    @property
    def ep_rank(self) -> int:
        return self.ep_ranks.index(comm.get_rank()) if comm.is_initialized() else 0

    @property
    def edp_size(self) -> int:
        return len(self.edp_ranks)


def _make(lists: list[list[int]], me: int, world: int) -> tuple[list[int], Any]:
    mine: tuple[list[int], Any] = ([me], None)
    for ranks in lists:
        group = comm.new_group(ranks) if world > 1 else None  # collective: every rank creates every group
        if me in ranks:
            mine = (ranks, group)
    return mine


def create_expert_groups(ep_size: int, data_before_expert: bool = False,
                         registry: dict[str, ExpertGroups] | None = None, mpu: Any = None) -> ExpertGroups:
    """Create (or reuse from ``registry``) the groups for ``ep_size``, inside the data-parallel groups of
    ``mpu``'s grid (a ``PipelineParallelGrid``; None: the whole world is one data-parallel group). Collective."""
    name = group_name(ep_size)
    if registry is not None and name in registry:
        return registry[name]
    world = comm.get_world_size() if comm.is_initialized() else 1
    me = comm.get_rank() if comm.is_initialized() else 0
    topo = getattr(mpu, "topology", lambda: None)() if mpu is not None else None
    if topo is None and mpu is not None and mpu.get_data_parallel_world_size() != world:
        raise ValueError("MoE expert groups inside a data-parallel group smaller than the world need a grid "
                         "with a topology() (zerospeed's PipelineParallelGrid), not this mpu")
    if topo is None:
        ep_lists, edp_lists = expert_rank_lists([list(range(world))], ep_size, data_before_expert)
    else:
        dp_lists = topo.get_axis_comm_lists("data") or [[r] for r in range(world)]
        ep_lists, edp_lists = expert_rank_lists(dp_lists, ep_size, data_before_expert)
    ep_ranks, ep_group = _make(ep_lists, me, world)
    edp_ranks, edp_group = _make(edp_lists, me, world)
    groups = ExpertGroups(name, ep_size, ep_ranks, edp_ranks, ep_group, edp_group)
    if registry is not None:
        registry[name] = groups
    return groups
