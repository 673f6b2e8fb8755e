"""Node-aware topology and hierarchical collectives: intra-node first, then across nodes.

Ranks are numbered node-major: rank ``r`` is local rank ``r % ranks_per_node`` of node ``r // ranks_per_node``
(torchrun's numbering). Two sets of groups cover the world: one *intra* group per node (its ranks) and one
*inter* group per local rank (that local rank on every node)::

    node 0: ranks 0 1 | node 1: ranks 2 3      intra groups: {0,1} {2,3}     inter groups: {0,2} {1,3}

* all-reduce: reduce-scatter inside the node, all-reduce each 1/ranks_per_node piece across nodes,
  all-gather inside the node: the inter-node traffic is 1/ranks_per_node of a flat all-reduce's;
* reduce-scatter (rank-ordered chunks): reduce-scatter inside the node (each local rank gets its chunks of
  every node), then across nodes;
* all-gather (rank order): across nodes first (each local rank's peers), then inside the node.

Each collective is logged under ``intra:<op>`` or ``inter:<op>``, so bytes are counted per level.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .backend import Group, get_rank, get_world_size, new_group
from .collectives import ReduceOp, _nbytes, _run, all_gather_work, reduce_scatter_work
from .recoverable import resolve


@dataclass(frozen=True)
class NodeLayout:
    """Which rank sits on which node (pure; no process groups)."""

    world: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}) must divide the world size ({self.world})")

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def intra_ranks(self, node: int) -> list[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def inter_ranks(self, local: int) -> list[int]:
        return [n * self.ranks_per_node + local for n in range(self.nodes)]


RANKS_PER_NODE_ENV = "ZEROSPEED_RANKS_PER_NODE"  # exported by ``zerospeed launch`` on every node


def ranks_per_node_from_env(default: int | None = None) -> int:
    """The launcher's ranks per node (``ZEROSPEED_RANKS_PER_NODE``, else torchrun's ``LOCAL_WORLD_SIZE``, else
    Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE``), else ``default``, else the world (one node)."""
    for name in (RANKS_PER_NODE_ENV, "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(name)
        if value:
            return int(value)
    return default if default is not None else get_world_size()


def intra_node_group(ranks_per_node: int) -> Group:
    """This rank's node group: consecutive blocks of ``ranks_per_node`` world ranks (every rank must call it)."""
    layout = NodeLayout(get_world_size(), ranks_per_node)
    groups = [new_group(layout.intra_ranks(n)) for n in range(layout.nodes)]
    return groups[layout.node_of(get_rank())]


class Hierarchy:
    """The intra- and inter-node groups of this rank (every rank must build it, in the same order).

    ``block``: a hierarchy inside each block of ``block`` consecutive world ranks (a MiCS shard group that spans
    nodes) instead of the whole world; ``rank`` and ``layout`` are then the block's.
    """

    def __init__(self, ranks_per_node: int | None = None, block: int | None = None) -> None:
        world = get_world_size()
        size = block or world
        if world % size:
            raise ValueError(f"block size {size} must divide the world size {world}")
        self.layout = NodeLayout(size, ranks_per_node or ranks_per_node_from_env())
        self.rank = get_rank() % size
        mine = get_rank() // size
        for b in range(world // size):
            base = b * size
            intra = [new_group([base + r for r in self.layout.intra_ranks(n)]) for n in range(self.layout.nodes)]
            inter = [new_group([base + r for r in self.layout.inter_ranks(i)]) for i in range(self.layout.ranks_per_node)]
            if b == mine:
                self.intra: Group = intra[self.layout.node_of(self.rank)]
                self.inter: Group = inter[self.layout.local_rank(self.rank)]


def _reduce_scatter(level: str, out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    if get_world_size(group) == 1:
        out.copy_(inp)
        return
    n = _nbytes(inp)
    _run(f"{level}:reduce_scatter", group, n, n, False,
         lambda: reduce_scatter_work(out, inp, group, ReduceOp.SUM, False))


def _all_gather(level: str, out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    if get_world_size(group) == 1:
        out.copy_(inp)
        return
    n = _nbytes(out)
    _run(f"{level}:all_gather", group, n, n, False, lambda: all_gather_work(out, inp, group, False))


def _all_reduce(level: str, t: torch.Tensor, group: Group) -> None:
    if get_world_size(group) == 1:
        return
    n = _nbytes(t)
    _run(f"{level}:all_reduce", group, n, 2 * n, False, lambda: dist.all_reduce(t, op=ReduceOp.SUM, group=resolve(group)))


@torch.no_grad()
def hierarchical_all_reduce(t: torch.Tensor, h: Hierarchy) -> None:
    """In-place sum over all ranks of the flat ``t`` (padded internally to a multiple of ranks_per_node)."""
    k = h.layout.ranks_per_node
    n = t.numel()
    flat = torch.zeros(n + (-n) % k, dtype=t.dtype, device=t.device)
    flat[:n].copy_(t.reshape(-1))
    piece = torch.empty(flat.numel() // k, dtype=t.dtype, device=t.device)
    _reduce_scatter("intra", piece, flat, h.intra)
    _all_reduce("inter", piece, h.inter)
    _all_gather("intra", flat, piece, h.intra)
    t.view(-1).copy_(flat[:n])


@torch.no_grad()
def hierarchical_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, h: Hierarchy) -> None:
    """``inp`` holds ``world`` equal chunks in rank order; ``out`` gets the sum over ranks of this rank's."""
    nodes, k = h.layout.nodes, h.layout.ranks_per_node
    c = out.numel()
    by_local = inp.reshape(nodes, k, c).transpose(0, 1).contiguous()  # [local][node][c]
    mine = torch.empty(nodes * c, dtype=inp.dtype, device=inp.device)
    _reduce_scatter("intra", mine, by_local.reshape(-1), h.intra)  # my local rank's chunks of every node
    _reduce_scatter("inter", out.reshape(-1), mine, h.inter)  # then my node's


@torch.no_grad()
def hierarchical_all_gather(out: torch.Tensor, inp: torch.Tensor, h: Hierarchy) -> None:
    """``out`` receives every rank's ``inp`` in rank order: across nodes first, then inside the node."""
    nodes, k = h.layout.nodes, h.layout.ranks_per_node
    c = inp.numel()
    peers = torch.empty(nodes * c, dtype=inp.dtype, device=inp.device)
    _all_gather("inter", peers, inp.reshape(-1), h.inter)  # [node][c] of my local rank
    by_local = torch.empty(k * nodes * c, dtype=inp.dtype, device=inp.device)
    _all_gather("intra", by_local, peers, h.intra)  # [local][node][c]
    out.view(nodes, k, c).copy_(by_local.view(k, nodes, c).transpose(0, 1))
