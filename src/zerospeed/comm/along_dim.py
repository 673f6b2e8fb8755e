"""All-gather and reduce-scatter along any dimension of an activation, with uneven per-rank sizes.

Tensor parallelism gathers a layer's output along its last (feature) dimension, and sequence parallelism
gathers / reduce-scatters along the sequence dimension. Both are the flat collectives of
:mod:`.collectives` on the tensor with ``dim`` moved to the front; uneven sizes (a column layer split
``[3, 2]``) are zero-padded to the largest and trimmed after, so one uniform collective runs.
Each rank passes the same ``sizes`` (they come from the deterministic shard-size rules).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .backend import Group, get_rank, get_world_size
from .collectives import Handle, all_gather, reduce_scatter


class PendingTensor:
    """The result of an async collective: ``wait()`` completes it and returns the tensor."""

    def __init__(self, handle: Handle | None, finish: Callable[[], torch.Tensor]) -> None:
        self._handle = handle
        self._finish = finish

    def wait(self) -> torch.Tensor:
        if self._handle is not None:
            self._handle.wait()
        return self._finish()


def _front(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.movedim(dim, 0).contiguous()


Sizes = list[int] | tuple[int, ...] | None


def all_gather_along_dim(input: torch.Tensor, dim: int, group: Group | None, sizes: Sizes = None,
                         async_op: bool = False) -> torch.Tensor | PendingTensor:
    """Concatenation along ``dim`` of every rank's ``input`` in rank order (``sizes[r]``: rank r's length).

    ``async_op``: returns a :class:`PendingTensor` (``wait()`` gives the concatenation).
    """
    world = get_world_size(group)
    if world == 1:
        return PendingTensor(None, lambda: input) if async_op else input
    dim = dim % input.dim()
    mine = input.shape[dim]
    sizes = list(sizes) if sizes is not None else [mine] * world
    if len(sizes) != world or sizes[get_rank(group)] != mine:
        raise ValueError(f"all_gather_along_dim: sizes {sizes} do not fit this rank's length {mine} over {world} ranks")
    longest = max(sizes)
    x = _front(input, dim)
    if mine != longest:
        x = torch.cat([x, x.new_zeros((longest - mine, *x.shape[1:]))])
    out = x.new_empty((world * longest, *x.shape[1:]))
    handle = all_gather(out.view(-1), x.view(-1), group, async_op=async_op)
    shape = x.shape[1:]

    def finish() -> torch.Tensor:
        full = out
        if min(sizes) != longest:
            chunks = out.view(world, longest, *shape)
            full = torch.cat([chunks[r, :n] for r, n in enumerate(sizes)])
        return full.movedim(0, dim)

    return PendingTensor(handle, finish) if async_op else finish()


def reduce_scatter_along_dim(input: torch.Tensor, dim: int, group: Group | None, sizes: Sizes = None,
                             async_op: bool = False) -> torch.Tensor | PendingTensor:
    """Sum over ranks of ``input``, each rank keeping its ``sizes[rank]`` slice along ``dim`` (rank order).

    ``async_op``: returns a :class:`PendingTensor` (``wait()`` gives the slice).
    """
    world = get_world_size(group)
    if world == 1:
        return PendingTensor(None, lambda: input) if async_op else input
    dim = dim % input.dim()
    total = input.shape[dim]
    if sizes is None:
        if total % world:
            raise ValueError(f"reduce_scatter_along_dim: length {total} along dim {dim} does not divide by "
                             f"{world} ranks")
        sizes = [total // world] * world
    sizes = list(sizes)
    if len(sizes) != world or sum(sizes) != total:
        raise ValueError(f"reduce_scatter_along_dim: sizes {sizes} do not tile length {total} over {world} ranks")
    longest = max(sizes)
    x = _front(input, dim)
    if min(sizes) != longest:
        padded = x.new_zeros((world, longest, *x.shape[1:]))
        for r, part in enumerate(x.split(sizes)):
            padded[r, : sizes[r]].copy_(part)
        x = padded.view(world * longest, *x.shape[1:])
    out = x.new_empty((longest, *x.shape[1:]))
    handle = reduce_scatter(out.view(-1), x.view(-1), group, async_op=async_op)
    mine = sizes[get_rank(group)]

    def finish() -> torch.Tensor:
        return out[:mine].movedim(0, dim)

    return PendingTensor(handle, finish) if async_op else finish()

