"""ZenFlow's selection, pure: which elements of a rank's flat partition are its "important" columns.

A 2-D weight ``[rows, cols]`` is flattened row-major, so its column ``j`` is the elements ``j, j + cols, ...``
(``weight[:, j]``; for ``nn.Linear`` one input feature). A rank owns a contiguous piece of each flattened
weight (``partition.py``), so it sees part of each column. Importance of column ``j`` = sum of ``|grad|``
over the whole column: each rank sums its part (``column_sums``), one all-reduce adds them, and every rank
picks the same ``max(1, int(cols * topk_ratio))`` columns (DeepSpeed's count). Parameters that are not
2-D (biases, norms) are always selected, as in DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...zero import ShardedGroup


@dataclass(frozen=True)
class Matrix:
    """The piece of 2-D weight ``index`` this rank owns: partition elements ``[start, start + n)`` hold the
    weight's flat elements ``[lo, lo + n)``; ``column[e]`` is the column of partition element ``start + e``."""

    index: int
    start: int
    lo: int
    n: int
    rows: int
    cols: int
    column: torch.Tensor


@dataclass(frozen=True)
class Layout:
    """A group's partition seen by ZenFlow: its 2-D pieces and the ``(start, n)`` of everything else."""

    matrices: tuple[Matrix, ...]
    others: tuple[tuple[int, int], ...]

    @property
    def num_columns(self) -> int:
        return sum(m.cols for m in self.matrices)


def layout_of(grp: ShardedGroup) -> Layout:
    rank = grp.rank if grp.num_partitions > 1 else 0
    mats: list[Matrix] = []
    others: list[tuple[int, int]] = []
    for i, slot in enumerate(grp.plan.slots):
        lo, hi = slot.owned_range(rank)
        start, _ = grp.slot_range(i)
        shape = grp.full_shape(i)
        if len(shape) == 2:
            rows, cols = int(shape[0]), int(shape[1])
            mats.append(Matrix(i, start, lo, hi - lo, rows, cols, torch.arange(lo, hi) % cols))
        elif hi > lo:
            others.append((start, hi - lo))
    return Layout(tuple(mats), tuple(others))


def column_sums(grad: torch.Tensor, lay: Layout) -> torch.Tensor:
    """This rank's part of each column's ``sum |grad|``, every matrix's columns one after the other."""
    out = torch.zeros(lay.num_columns, dtype=torch.float32)
    at = 0
    for m in lay.matrices:
        if m.n:
            out[at:at + m.cols].index_add_(0, m.column, grad[m.start:m.start + m.n].abs().float())
        at += m.cols
    return out


def num_selected(cols: int, topk_ratio: float) -> int:
    """DeepSpeed's count of selected columns."""
    return 0 if cols == 0 else max(1, int(cols * topk_ratio))


def top_columns(sums: torch.Tensor, lay: Layout, topk_ratio: float) -> list[torch.Tensor]:
    """Per matrix, its ``num_selected`` most important columns (sorted), from the all-reduced sums."""
    out, at = [], 0
    for m in lay.matrices:
        k = num_selected(m.cols, topk_ratio)
        out.append(torch.topk(sums[at:at + m.cols], k).indices.sort().values)
        at += m.cols
    return out


def selected_elements(lay: Layout, columns: list[torch.Tensor]) -> torch.Tensor:
    """Partition indices (sorted) of the selected columns' elements and of every non-2-D parameter."""
    parts = [torch.arange(s, s + n) for s, n in lay.others]
    for m, cols in zip(lay.matrices, columns):
        if m.n:
            parts.append(torch.nonzero(torch.isin(m.column, cols)).flatten() + m.start)
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(parts).sort().values


def matrix_sums(sums: torch.Tensor, lay: Layout, columns: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per matrix: total ``sum |grad|`` and that of its selected columns (ZenFlow's auto update rule)."""
    total, critical, at = [], [], 0
    for m, cols in zip(lay.matrices, columns):
        s = sums[at:at + m.cols]
        total.append(s.sum())
        critical.append(s[cols].sum())
        at += m.cols
    if not total:
        return torch.zeros(0), torch.zeros(0)
    return torch.stack(total), torch.stack(critical)
