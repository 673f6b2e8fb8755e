"""The Ulysses exchange: sequence-sharded tensors become head-sharded, and back, in one all-to-all each.

A rank of a sequence group of P holds ``s/P`` positions of every head. ``seq_to_head`` sends head block j to
rank j and receives every rank's positions of its own heads, so afterwards it holds all ``s`` positions of
``heads[rank]`` heads (attention needs the whole sequence of a head, not all heads)::

    before (rank r):  [.. s/P ..] x [h_0 | h_1 | ... | h_{P-1}]      (seq dim local, head dim whole)
    after  (rank r):  [s_0 | s_1 | ... | s_{P-1}] x [h_r]              (seq dim whole, head dim local)

``head_to_seq`` is the inverse, and each is the other's backward (``SeqAllToAll``). Head blocks may be
uneven (``head_splits``: 7 heads on 2 ranks are 4 + 3); positions are always split evenly. The planner
``plan_heads`` decides the blocks from the query and key/value head counts (GQA) and is pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ... import comm


@dataclass(frozen=True)
class HeadPlan:
    """How the heads of one attention call are spread over a sequence group of ``world`` ranks.

    ``kv_repeat`` > 1 (fewer key/value heads than ranks): each key/value head is repeated that many times
    before the exchange, so every rank receives exactly one. ``q_splits[r]`` / ``kv_splits[r]``: query and
    (repeated) key/value heads rank r attends over; each rank's query heads share its key/value heads.
    """

    world: int
    q_heads: int
    kv_heads: int
    kv_repeat: int
    q_splits: tuple[int, ...]
    kv_splits: tuple[int, ...]


def plan_heads(q_heads: int, kv_heads: int, world: int) -> HeadPlan:
    """Split ``q_heads`` query and ``kv_heads`` key/value heads over ``world`` ranks, following the KV groups.

    Rank r gets ``kv_heads // world`` groups, one more for ``r < kv_heads % world`` (DeepSpeed's uneven
    split); its query heads are those groups' queries. With fewer KV heads than ranks each KV head is
    repeated ``world // kv_heads`` times. Counts that cannot be split raise ``ValueError`` with the numbers.
    """
    if min(q_heads, kv_heads, world) < 1:
        raise ValueError(f"head counts and sequence-parallel size must be >= 1, got q_heads={q_heads}, "
                         f"kv_heads={kv_heads}, sequence_parallel_size={world}")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads (GQA needs "
                         "whole groups)")
    group = q_heads // kv_heads  # query heads per key/value head
    if kv_heads >= world:
        kv = tuple(kv_heads // world + (1 if r < kv_heads % world else 0) for r in range(world))
        return HeadPlan(world, q_heads, kv_heads, 1, tuple(k * group for k in kv), kv)
    if world % kv_heads or q_heads % world:
        raise ValueError(f"cannot split {q_heads} query / {kv_heads} key-value heads over sequence-parallel size "
                         f"{world}: with fewer key/value heads than ranks, the size must be a multiple of the "
                         f"key/value heads and divide the query heads (e.g. sequence_parallel_size "
                         f"{_suggest(q_heads, kv_heads, world)})")
    return HeadPlan(world, q_heads, kv_heads, world // kv_heads, (q_heads // world,) * world, (1,) * world)


def _suggest(q_heads: int, kv_heads: int, world: int) -> str:
    ok = [p for p in range(1, world + 1) if p <= kv_heads or (p % kv_heads == 0 and q_heads % p == 0)]
    return f"{max(ok)} or fewer" if ok else "1"


def seq_to_head(x: torch.Tensor, group: Any, seq_dim: int, head_dim: int, head_splits: tuple[int, ...]) -> torch.Tensor:
    """Gather the sequence and scatter the heads: ``[.., s/P, .., H, ..]`` -> ``[.., s, .., heads[rank], ..]``."""
    world, rank = len(head_splits), comm.get_rank(group)
    if x.shape[head_dim] != sum(head_splits):
        raise ValueError(f"tensor has {x.shape[head_dim]} heads at dim {head_dim}, expected {sum(head_splits)}")
    if world == 1:
        return x
    # Heads first: block j (head_splits[j] heads, all my positions) goes to rank j.
    send = x.movedim(head_dim, 0).contiguous()
    rest = send.shape[1:]
    row = rest.numel()
    mine = head_splits[rank]
    recv = torch.empty(world * mine * row, dtype=x.dtype, device=x.device)
    comm.all_to_all_single(recv, send.reshape(-1), [mine * row] * world, [h * row for h in head_splits], group)
    # recv: [P, mine, *rest]; put P just before the (local) sequence dim and merge them.
    s = seq_dim - (1 if seq_dim > head_dim else 0)  # the sequence dim's index within ``rest``
    out = recv.view(world, mine, *rest).movedim(0, s + 1).flatten(s + 1, s + 2)
    return out.movedim(0, head_dim).contiguous()


def head_to_seq(y: torch.Tensor, group: Any, seq_dim: int, head_dim: int, head_splits: tuple[int, ...]) -> torch.Tensor:
    """The inverse: ``[.., s, .., heads[rank], ..]`` -> ``[.., s/P, .., H, ..]``."""
    world, rank = len(head_splits), comm.get_rank(group)
    if world == 1:
        return y
    if y.shape[seq_dim] % world:
        raise ValueError(f"sequence length {y.shape[seq_dim]} is not divisible by sequence-parallel size {world}")
    if y.shape[head_dim] != head_splits[rank]:
        raise ValueError(f"tensor has {y.shape[head_dim]} heads at dim {head_dim}, rank {rank} expects "
                         f"{head_splits[rank]}")
    # Sequence first, cut into P blocks: block j (s/P positions of my heads) goes to rank j.
    send = y.movedim(seq_dim, 0).contiguous()
    local = send.shape[0] // world
    rest = send.shape[1:]  # holds my heads at index h
    h = head_dim - (1 if head_dim > seq_dim else 0)
    unit = local * rest.numel() // rest[h]  # elements of one head's block
    recv = torch.empty(unit * sum(head_splits), dtype=y.dtype, device=y.device)
    comm.all_to_all_single(recv, send.reshape(-1), [n * unit for n in head_splits],
                           [unit * head_splits[rank]] * world, group)
    shape = [local, *rest]
    pieces = []
    for j, piece in enumerate(recv.split([n * unit for n in head_splits])):
        shape[h + 1] = head_splits[j]
        pieces.append(piece.view(shape))
    out = torch.cat(pieces, dim=h + 1)
    return out.movedim(0, seq_dim).contiguous()


class SeqAllToAll(torch.autograd.Function):
    """Differentiable exchange: ``to_heads`` selects ``seq_to_head`` (else ``head_to_seq``); the backward
    of each is the other, on the same group, dims and head blocks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, seq_dim: int, head_dim: int,  # type: ignore[override]
                head_splits: tuple[int, ...], to_heads: bool) -> torch.Tensor:
        ctx.args = (group, seq_dim, head_dim, head_splits, to_heads)
        return (seq_to_head if to_heads else head_to_seq)(x, group, seq_dim, head_dim, head_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        group, seq_dim, head_dim, head_splits, to_heads = ctx.args
        inverse = head_to_seq if to_heads else seq_to_head
        return inverse(grad.contiguous(), group, seq_dim, head_dim, head_splits), None, None, None, None, None


def all_to_all_seq_heads(x: torch.Tensor, group: Any, seq_dim: int, head_dim: int, head_splits: tuple[int, ...],
                         to_heads: bool = True) -> torch.Tensor:
    """``SeqAllToAll.apply`` with keyword names."""
    out = SeqAllToAll.apply(x, group, seq_dim, head_dim, tuple(head_splits), to_heads)
    assert isinstance(out, torch.Tensor)
    return out
