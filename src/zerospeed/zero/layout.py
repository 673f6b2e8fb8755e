"""Copying a parameter's (padded, flattened) elements in and out of a rank-major ``[N, S]`` buffer view.

A parameter of ``n`` elements with shard size ``s`` occupies column block ``[col, col+s)`` of every
row ``r`` of the ``[N, S]`` view: row r holds the parameter's elements ``[r*s, (r+1)*s)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .partition import ParamSlot


def scatter_into(buf2d: torch.Tensor, col: int, shard: int, flat: torch.Tensor, accumulate: bool) -> None:
    """Write (or add) the flat parameter tensor ``flat`` into its column block of ``buf2d``."""
    n = flat.numel()
    q, r = divmod(n, shard)
    if q:
        dst = buf2d[:q, col:col + shard]
        src = flat[: q * shard].view(q, shard)
        dst.add_(src) if accumulate else dst.copy_(src)
    if r:
        dst = buf2d[q, col:col + r]
        src = flat[q * shard:]
        dst.add_(src) if accumulate else dst.copy_(src)


def gather_from(buf2d: torch.Tensor, col: int, shard: int, flat: torch.Tensor) -> None:
    """Copy a parameter's column block of ``buf2d`` back into the flat parameter tensor ``flat``."""
    n = flat.numel()
    q, r = divmod(n, shard)
    if q:
        flat[: q * shard].view(q, shard).copy_(buf2d[:q, col:col + shard])
    if r:
        flat[q * shard:].copy_(buf2d[q, col:col + r])


def padding_ranges(slots: Iterable[ParamSlot], rows: int) -> list[tuple[int, int, int]]:
    """Where no element of these parameters lands in a ``[rows, S]`` buffer: ``(row, lo, hi)`` means
    columns ``[lo, hi)`` of rows ``row`` to the last (the padding of each parameter's column block)."""
    out = []
    for slot in slots:
        q, r = divmod(slot.numel, slot.shard)
        if r:
            out.append((q, slot.offset + r, slot.offset + slot.shard))
        if q + (1 if r else 0) < rows:
            out.append((q + (1 if r else 0), slot.offset, slot.offset + slot.shard))
    return out
