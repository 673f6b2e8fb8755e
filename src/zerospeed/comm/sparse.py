"""Top-k sparsified all-reduce with error feedback: each rank sends only its k largest gradient entries.

    r = residual + x                      (error feedback: what earlier calls did not send)
    S = indices of the k = ceil(ratio * n) largest |r|;  send (S, r[S]);  residual = r with r[S] = 0
    all-gather of every rank's k indices (int32) and k values  ->  sum = scatter-add of all of them

Every rank ends with the same dense sum of the sparse contributions. On the wire a rank's message is
``8k`` bytes (4 for an index, 4 for an fp32 value) against ``4n`` for a dense fp32 all-reduce, gathered
from every rank: the all-gather output is ``world * 8k`` bytes, a ring all-reduce moves ``2 * 4n``.
Without error feedback (``residual`` None) unsent entries are dropped. With ``scale`` (same shape, e.g. Adam's
frozen ``1 / (sqrt(v) + eps)``) the entries are chosen by ``|r| * scale`` instead of ``|r|``; the values sent
are still ``r[S]``.

:func:`union_sparse_all_reduce` sends every selected entry exactly: the ranks all-gather only their top-k
indices (``world * 4k`` bytes), then all-reduce their values at the union ``U`` of those indices (a ring
moves ``2 * 4|U|``, ``|U| <= world * k``), and every rank clears ``U`` from its residual. An entry one rank
selected carries the other ranks' accumulated values too, instead of leaving them behind in their residuals.
"""

from __future__ import annotations

import math

import torch

from .backend import Group, device_for_backend, get_world_size
from .collectives import ReduceOp, all_gather, all_reduce


def topk_count(numel: int, ratio: float) -> int:
    """Entries each rank sends: ``ceil(ratio * numel)``, at least 1 (0 for an empty buffer)."""
    return 0 if numel == 0 else min(numel, max(1, math.ceil(ratio * numel)))


@torch.no_grad()
def sparse_all_reduce(buffer: torch.Tensor, ratio: float, residual: torch.Tensor | None = None,
                      group: Group | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Replace the flat ``buffer`` by the sum over ranks of each rank's top-k of ``buffer + residual``
    (ranked by ``|buffer + residual| * scale`` when ``scale`` is given). Returns this rank's sent indices."""
    n = buffer.numel()
    k = topk_count(n, ratio)
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=buffer.device)
    acc = buffer.float() if residual is None else residual.add_(buffer.float())
    score = acc.abs() if scale is None else acc.abs().mul_(scale)
    idx = torch.topk(score, k, sorted=False).indices
    values = acc[idx]
    if residual is not None:
        residual.index_fill_(0, idx, 0.0)
    world = get_world_size(group)
    all_idx = torch.empty(world * k, dtype=torch.int32, device=buffer.device)
    all_val = torch.empty(world * k, dtype=values.dtype, device=buffer.device)
    all_gather(all_idx, idx.to(torch.int32), group)
    all_gather(all_val, values, group)
    dense = torch.zeros(n, dtype=values.dtype, device=buffer.device)
    dense.index_add_(0, all_idx.long(), all_val)
    buffer.copy_(dense)
    return idx


@torch.no_grad()
def row_sparse_all_reduce(matrix: torch.Tensor, group: Group | None = None) -> None:
    """Replace the 2-D ``matrix`` by its sum over ranks, sending only its nonzero rows (DeepSpeed's
    ``sparse_gradients``): every rank all-gathers (row index, row) pairs, padded to the largest count."""
    rows = matrix.ne(0).any(dim=1).nonzero().flatten()
    count = torch.tensor([float(rows.numel())], device=device_for_backend(group))
    all_reduce(count, group=group, op=ReduceOp.MAX)
    k, world = int(count.item()), get_world_size(group)
    idx = torch.zeros(k, dtype=torch.int64, device=matrix.device)  # padding: zero rows added to row 0
    idx[:rows.numel()] = rows
    values = torch.zeros(k, matrix.shape[1], dtype=matrix.dtype, device=matrix.device)
    values[:rows.numel()] = matrix[rows]
    all_idx = torch.empty(world * k, dtype=torch.int64, device=matrix.device)
    all_val = torch.empty(world * k, matrix.shape[1], dtype=matrix.dtype, device=matrix.device)
    all_gather(all_idx, idx, group)
    all_gather(all_val, values, group)
    matrix.zero_().index_add_(0, all_idx, all_val)


@torch.no_grad()
def union_sparse_all_reduce(buffer: torch.Tensor, ratio: float, residual: torch.Tensor,
                            group: Group | None = None) -> torch.Tensor:
    """Replace the flat fp32 ``buffer`` by the sum over ranks of ``buffer + residual`` at the union of every
    rank's top-k indices (zeros elsewhere); the union is cleared from ``residual``. Returns the union."""
    n = buffer.numel()
    k = topk_count(n, ratio)
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=buffer.device)
    acc = residual.add_(buffer)
    idx = torch.topk(acc.abs(), k, sorted=False).indices
    world = get_world_size(group)
    all_idx = torch.empty(world * k, dtype=torch.int32, device=buffer.device)
    all_gather(all_idx, idx.to(torch.int32), group)
    chosen = torch.zeros(n, dtype=torch.bool, device=buffer.device)
    chosen[all_idx.long()] = True
    union = chosen.nonzero().squeeze(1)  # ascending: the same order on every rank
    values = acc[union]
    all_reduce(values, group)
    residual.index_fill_(0, union, 0.0)
    buffer.zero_().index_copy_(0, union, values)
    return union
