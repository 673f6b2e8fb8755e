"""Cutting a list of layers into pipeline stages (pure; DeepSpeed's boundaries for the same inputs).

A partition is a list ``parts`` of ``num_parts + 1`` layer indices: stage ``s`` owns layers
``parts[s] <= i < parts[s + 1]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal counts; the first ``num_items % num_parts`` parts get one more. Fewer items than parts: one each."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, extra = divmod(num_items, num_parts)
    return [p * chunk + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous parts whose weight sums are as even as possible (max - min part weight minimised).

    Dynamic programming over (prefix length, parts used); among equal costs the last split point
    considered wins, which reproduces DeepSpeed's tie-breaking and so its stage boundaries.
    """
    n, m = len(weights), num_parts
    if m < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    hi = [[inf] * (m + 1) for _ in range(n + 1)]
    lo = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    where = [[0] * (m + 1) for _ in range(n + 1)]
    hi[0][0] = 0.0
    cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                top, bottom = max(hi[k][j - 1], part), min(lo[k][j - 1], part)
                c = top - bottom
                if cost[i][j] >= c:
                    cost[i][j], hi[i][j], lo[i][j], where[i][j] = c, top, bottom, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(where[parts[-1]][j])
    return parts[::-1]
