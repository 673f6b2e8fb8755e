"""Muon under ZeRO 1-3: each matrix is orthogonalised whole, by one owner rank.

Every parameter is cut into N equal shards, one per rank (``partition.py``), so every Muon matrix spans
all ranks. Muon's momentum and Nesterov blend are element-wise and stay on the shards (state partitioned as
ZeRO promises); only Newton-Schulz needs the whole blended update ``u``. Rather than all-gathering every
matrix to every rank (N times the compute, every rank receiving every matrix), whole matrices are assigned to
ranks, as DeepSpeed's distributed Muon does (largest first, to the least loaded rank):

    all_to_all #1: rank r sends its shard of matrix j to owner(j)   -> owner holds u_j whole
    owner:         o_j = NS(u_j) * scale                              (1/N of the matrices per rank)
    all_to_all #2: owner sends shard r of o_j back to rank r          -> every rank holds its shard of o_j

Range map of rank r's send buffer of #1 (rank-major by destination; each piece is one slot, padding included)::

    [ to 0: shard_r(u_j) for j owned by 0 | to 1: ... | ... | to N-1: ... ]

and the owner's receive buffer, viewed ``[N, L_owner]``: row s holds rank s's shards of the owner's matrices,
so column block j of all rows, flattened, is matrix j padded to ``N * shard``. Exchange #2 is #1 reversed.
Per rank and step that moves ~2 x (N-1)/N x (Muon elements)/N instead of an all-gather's (N-1)/N x all.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import torch

from .. import comm
from ..optim.newton_schulz import orthogonalize
from .sharded_group import ShardedGroup


def assign_owners(numels: Sequence[int], world: int) -> list[int]:
    """Owner rank of each matrix: largest first to the least-loaded rank (ties: lower index, lower rank)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    owners = [0] * len(numels)
    load = [(0, r) for r in range(world)]
    heapq.heapify(load)
    for j in sorted(range(len(numels)), key=lambda j: (-numels[j], j)):
        used, r = heapq.heappop(load)
        owners[j] = r
        heapq.heappush(load, (used + numels[j], r))
    return owners


class MuonShardExchange:
    """``MuonWithAuxAdam.shard_orthogonalizer`` for the ZeRO optimizer's sharded groups (collective: every
    rank of a group calls it with the same matrices in the same order, as the optimizer step does)."""

    def __init__(self, groups: list[ShardedGroup], group_of: Callable[[ShardedGroup], comm.Group | None]) -> None:
        self._where: dict[int, tuple[ShardedGroup, int]] = {}
        for grp in groups:
            if grp.num_partitions > 1:
                for i, mp in enumerate(grp.master_params):
                    self._where[id(mp)] = (grp, i)
        self._group_of = group_of

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self._where

    @torch.no_grad()
    def __call__(self, items: list[tuple[torch.Tensor, torch.Tensor, str]]) -> list[torch.Tensor]:
        """This rank's shards of ``NS(u) * scale`` for each ``(master shard, blended update u, ns_method)``."""
        by_group: dict[int, list[int]] = {}
        for k, (p, _, _) in enumerate(items):
            by_group.setdefault(id(self._where[id(p)][0]), []).append(k)
        out: list[torch.Tensor | None] = [None] * len(items)
        for ks in by_group.values():
            grp = self._where[id(items[ks[0]][0])][0]
            results = self._exchange(grp, [(self._where[id(items[k][0])][1], items[k][1], items[k][2]) for k in ks])
            for k, r in zip(ks, results):
                out[k] = r
        return [r for r in out if r is not None]

    def _exchange(self, grp: ShardedGroup, mats: list[tuple[int, torch.Tensor, str]]) -> list[torch.Tensor]:
        n, me = grp.num_partitions, grp.rank
        for i, _, _ in mats:  # checked on every rank before any exchange, so all ranks fail alike
            if len(grp.full_shape(i)) < 2:
                raise ValueError(f"Muon updates matrices (ndim >= 2), got a parameter of shape "
                                 f"{tuple(grp.full_shape(i))}; give it to the auxiliary Adam (use_muon = False)")
        pg = self._group_of(grp)
        slots = [grp.plan.slots[i] for i, _, _ in mats]
        owners = assign_owners([s.numel for s in slots], n)
        dev = comm.device_for_backend(pg)
        mine = [j for j in range(len(mats)) if owners[j] == me]
        # exchange #1: each shard of u to its matrix's owner
        by_dest = [[j for j in range(len(mats)) if owners[j] == d] for d in range(n)]
        send = torch.cat([mats[j][1].reshape(-1).float() for d in range(n) for j in by_dest[d]]).to(dev)
        send_sizes = [sum(slots[j].shard for j in by_dest[d]) for d in range(n)]
        row = sum(slots[j].shard for j in mine)
        recv = torch.empty(row * n, dtype=send.dtype, device=dev)
        comm.all_to_all_single(recv, send, [row] * n, send_sizes, group=pg)
        # the owner: whole matrices, orthogonalised, cut back into shards
        recv2d, back2d = recv.view(n, row), torch.empty(n, row, dtype=send.dtype, device=dev)
        off = 0
        for j in mine:
            s, shape = slots[j].shard, grp.full_shape(mats[j][0])
            full = recv2d[:, off:off + s].reshape(-1)[: slots[j].numel].view(shape)
            padded = torch.zeros(n * s, dtype=send.dtype, device=dev)
            padded[: slots[j].numel] = orthogonalize(full, mats[j][2]).reshape(-1)
            back2d[:, off:off + s] = padded.view(n, s)
            off += s
        # exchange #2: shard r of each result back to rank r
        got = torch.empty(sum(send_sizes), dtype=send.dtype, device=dev)
        comm.all_to_all_single(got, back2d.reshape(-1), send_sizes, [row] * n, group=pg)
        results: list[torch.Tensor | None] = [None] * len(mats)
        off = 0
        for d in range(n):
            for j in by_dest[d]:
                u = mats[j][1]
                results[j] = got[off:off + slots[j].shard].to(device=u.device, dtype=u.dtype).view(u.shape)
                off += slots[j].shard
        return [r for r in results if r is not None]
