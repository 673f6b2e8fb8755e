"""Which slice of a full tensor a tensor-parallel rank holds: a pure description, and cut / reassemble.

A :class:`TPShardSpec` describes one parameter's split::

    full tensor, dim ``dim`` =  [ sub-param 0 | sub-param 1 | ... ]      (one sub-param unless fused)
    sub-param j             =  [ rank 0: widths[j][0] | rank 1: widths[j][1] | ... ]
    rank r's shard          =  cat_j( rank r's piece of sub-param j )   along ``dim``

A fused QKV weight (sub-params q, k, v) thus gives rank r ``[q_r; k_r; v_r]``, not one contiguous block.
``dim=None`` means the parameter is replicated (a row-parallel bias). Checkpoint resharding and export
use :func:`shard` and :func:`unshard` with a spec, with no process group involved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPShardSpec:
    """One parameter's tensor-parallel layout (``dim=None``: replicated on every rank)."""

    full_shape: tuple[int, ...]
    dim: int | None
    widths: tuple[tuple[int, ...], ...] = ()   # per sub-param, per rank

    @property
    def tp_size(self) -> int:
        return len(self.widths[0]) if self.widths else 1

    @property
    def subparam_sizes(self) -> tuple[int, ...]:
        return tuple(sum(w) for w in self.widths)

    def local_size(self, rank: int) -> int:
        """Length along ``dim`` of rank ``rank``'s shard."""
        return sum(w[rank] for w in self.widths)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = self.local_size(rank)
        return tuple(shape)

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """``[start, stop)`` ranges along ``dim`` of the full tensor that rank ``rank`` holds, in shard order."""
        if self.dim is None:
            return [(0, self.full_shape[0] if self.full_shape else 1)]
        out, base = [], 0
        for w in self.widths:
            start = base + sum(w[:rank])
            out.append((start, start + w[rank]))
            base += sum(w)
        return out


def even_spec(full_shape: tuple[int, ...], dim: int, sizes: tuple[int, ...] | list[int]) -> TPShardSpec:
    """A plain split of ``dim`` into per-rank ``sizes`` (no sub-params)."""
    return TPShardSpec(tuple(full_shape), dim, (tuple(sizes),))


def shard(full: torch.Tensor, spec: TPShardSpec, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a view when it is one range; a new tensor otherwise)."""
    if tuple(full.shape) != spec.full_shape:
        raise ValueError(f"tensor of shape {tuple(full.shape)} does not match the spec's {spec.full_shape}")
    if spec.dim is None:
        return full
    pieces = [full.narrow(spec.dim, a, b - a) for a, b in spec.ranges(rank)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)


def unshard(shards: list[torch.Tensor], spec: TPShardSpec, dim: int | None = None) -> torch.Tensor:
    """The full tensor from every rank's shard (in rank order); ``dim`` overrides ``spec.dim``
    (an activation whose last dimension is laid out like a weight's dim 0)."""
    if spec.dim is None:
        return shards[0]
    if len(shards) != spec.tp_size:
        raise ValueError(f"got {len(shards)} shards for a spec over {spec.tp_size} ranks")
    d = spec.dim if dim is None else dim
    per_rank = [list(s.split([w[r] for w in spec.widths], dim=d)) for r, s in enumerate(shards)]
    subparams = [torch.cat([per_rank[r][j] for r in range(spec.tp_size)], dim=d) for j in range(len(spec.widths))]
    return subparams[0] if len(subparams) == 1 else torch.cat(subparams, dim=d)


def regroup_gathered(gathered: torch.Tensor, spec: TPShardSpec, dim: int = -1) -> torch.Tensor:
    """Rank-order concatenation ``[q0 k0 v0 | q1 k1 v1]`` along ``dim`` back to sub-param order ``[q | k | v]``."""
    if spec.dim is None or len(spec.widths) == 1:
        return gathered
    shards = list(gathered.split([spec.local_size(r) for r in range(spec.tp_size)], dim=dim))
    return unshard(shards, spec, dim=dim)
