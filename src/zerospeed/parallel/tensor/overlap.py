"""A column-parallel matmul whose input-gradient collective overlaps the weight-gradient matmul.

Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``. Forward: ``y = x W^T + b``, with ``x``
first all-gathered along the sequence under sequence parallelism. Backward::

    (SP: start all-gather of x)
    dx = dy W                      (SP: wait for x)  then start  all-reduce(dx)  (SP: reduce-scatter along seq)
    dW = dy^T x ; db = sum(dy)     while the collective is in flight
    wait                           dx is complete

Under sequence parallelism only this rank's ``seq/tp`` tokens of ``x`` are kept for backward and the
full input is gathered again there (overlapped with ``dy W``), so the saved activation is ``1/tp`` of the
gathered one.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import comm


class ColumnParallelMatmul(torch.autograd.Function):
    """``apply(x, weight, bias, group, async_grad, seq_dim)``; ``seq_dim=None``: no sequence parallelism."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any,
                async_grad: bool, seq_dim: int | None) -> torch.Tensor:
        ctx.group, ctx.async_grad, ctx.seq_dim = group, async_grad, seq_dim
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        full = x if seq_dim is None else comm.all_gather_along_dim(x, seq_dim, group)
        return torch.nn.functional.linear(full, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        group, seq_dim = ctx.group, ctx.seq_dim
        gathering: Any = None if seq_dim is None else comm.all_gather_along_dim(x, seq_dim, group,
                                                                                 async_op=ctx.async_grad)
        grad = grad.contiguous()
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        if gathering is None:
            full = x
        else:
            full = gathering.wait() if ctx.async_grad else gathering
        pending: Any = None
        if grad_x is not None:
            if seq_dim is None:
                pending = comm.all_reduce(grad_x, group, async_op=ctx.async_grad)
            else:
                pending = comm.reduce_scatter_along_dim(grad_x, seq_dim, group, async_op=ctx.async_grad)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if grad_x is not None:
            if seq_dim is not None:
                grad_x = pending.wait() if ctx.async_grad else pending
            elif ctx.async_grad:
                pending.wait()
        return grad_x, grad_w, grad_b, None, None, None
