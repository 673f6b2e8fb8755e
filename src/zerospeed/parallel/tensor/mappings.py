"""Autograd mappings in and out of the tensor-parallel region (Megatron's ``mappings.py``).

Each mapping is a pair of collectives, one per direction, chosen so the backward is the adjoint of the
forward::

    copy_to_tensor_model_parallel_region        fwd identity              bwd all-reduce
    reduce_from_tensor_model_parallel_region    fwd all-reduce            bwd identity
    scatter_to_tensor_model_parallel_region     fwd keep my last-dim cut  bwd all-gather last dim
    gather_from_tensor_model_parallel_region    fwd all-gather last dim   bwd keep my last-dim cut
    scatter_to_sequence_parallel_region         fwd keep my seq cut       bwd all-gather seq
    gather_from_sequence_parallel_region        fwd all-gather seq        bwd reduce-scatter seq (or keep my cut)
    reduce_scatter_to_sequence_parallel_region  fwd reduce-scatter seq    bwd all-gather seq

``group=None`` means no tensor parallelism (DeepSpeed's ``mp_group=None``): every mapping is the identity.
Last-dim mappings take optional per-rank ``sizes`` for uneven splits; sequence mappings need the
sequence length to divide by the group size.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import comm


def tp_world_size(group: Any) -> int:
    """Size of a tensor-parallel group; 1 for ``None`` (no tensor parallelism)."""
    return 1 if group is None else comm.get_world_size(group)


def tp_rank(group: Any) -> int:
    """This rank's index in a tensor-parallel group; 0 for ``None``."""
    return 0 if group is None else comm.get_rank(group)


def _my_cut(x: torch.Tensor, dim: int, group: Any, sizes: Any) -> torch.Tensor:
    world, rank = tp_world_size(group), tp_rank(group)
    total = x.shape[dim]
    if sizes is None:
        if total % world:
            raise ValueError(f"a length of {total} along dim {dim} does not divide by tensor-parallel size {world}")
        sizes = [total // world] * world
    if sum(sizes) != total:
        raise ValueError(f"sizes {list(sizes)} do not tile a length of {total} along dim {dim}")
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


def _seq_sizes(total: int, group: Any, what: str) -> None:
    world = tp_world_size(group)
    if total % world:
        raise ValueError(f"sequence parallelism: {what} sequence length {total} does not divide by tensor-parallel "
                         f"size {world}; pad the sequence to a multiple of {world}")


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.contiguous().clone()
        comm.all_reduce(g, ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, sizes: Any) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return _my_cut(x, dim, group, sizes)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return comm.all_gather_along_dim(g, ctx.dim, ctx.group, ctx.sizes), None, None, None


class _Gather(torch.autograd.Function):
    """All-gather along ``dim``; backward keeps this rank's cut, or reduce-scatters when ``reduce_grad``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, sizes: Any, reduce_grad: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.sizes, ctx.reduce_grad = group, dim, sizes, reduce_grad
        return comm.all_gather_along_dim(x, dim, group, sizes)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        if ctx.reduce_grad:
            out = comm.reduce_scatter_along_dim(g, ctx.dim, ctx.group, ctx.sizes)
        else:
            out = _my_cut(g, ctx.dim, ctx.group, ctx.sizes)
        return out, None, None, None, None  # type: ignore[return-value]


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return comm.reduce_scatter_along_dim(x, dim, group)  # type: ignore[return-value]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return comm.all_gather_along_dim(g, ctx.dim, ctx.group), None, None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient (the input of a column-parallel layer)."""
    return x if tp_world_size(group) == 1 else _Copy.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce forward (the partial outputs of a row-parallel layer); identity backward."""
    return x if tp_world_size(group) == 1 else _Reduce.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Any, sizes: Any = None) -> torch.Tensor:
    """Keep this rank's cut of the last dimension; the gradient is all-gathered back to full width."""
    return x if tp_world_size(group) == 1 else _Scatter.apply(x, group, -1, _tuple(sizes))


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Any, sizes: Any = None) -> torch.Tensor:
    """All-gather the last dimension (``sizes``: each rank's width); the gradient keeps this rank's cut."""
    return x if tp_world_size(group) == 1 else _Gather.apply(x, group, -1, _tuple(sizes), False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Any, seq_dim: int = 1) -> torch.Tensor:
    """Enter a sequence-parallel region from a replicated tensor: keep ``seq / tp`` tokens."""
    if tp_world_size(group) == 1:
        return x
    _seq_sizes(x.shape[seq_dim], group, "input")
    return _Scatter.apply(x, group, seq_dim, None)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Any, seq_dim: int = 1,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence (before a column-parallel layer); the gradient is reduce-scattered.

    ``tensor_parallel_output_grad=False`` when the consumer is replicated (its gradient is already the
    same on every rank): the backward then keeps this rank's tokens without communicating.
    """
    if tp_world_size(group) == 1:
        return x
    return _Gather.apply(x, group, seq_dim, None, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Any, seq_dim: int = 1) -> torch.Tensor:
    """Sum partial outputs and keep ``seq / tp`` tokens (after a row-parallel layer); all-gather backward."""
    if tp_world_size(group) == 1:
        return x
    _seq_sizes(x.shape[seq_dim], group, "output")
    return _ReduceScatter.apply(x, group, seq_dim)


def _tuple(sizes: Any) -> tuple[int, ...] | None:
    return None if sizes is None else tuple(int(s) for s in sizes)
