"""Expert tensor parallelism (DeepSpeed's ``enable_expert_tensor_parallelism=True``): experts split over the
tensor-parallel group of an ``mpu``, and the token moves around them.

The ``tp`` ranks of a tensor-parallel group hold the same tokens (tensor parallelism replicates activations
between its layers). So, as DeepSpeed does, each ``tp`` rank sends only its ``1/tp`` slice of the capacity
dimension through the all-to-all, the slices are all-gathered inside the ``tp`` group before the (split)
experts run, and the reverse on the way back::

    [E, C, M] --drop--> [E, C/tp, M] --all-to-all--> --gather--> experts --drop--> --all-to-all--> --gather--> [E, C, M]

The backward of a drop is a gather and the reverse (the gradients arriving are the same on every ``tp``
rank). At ``ep == 1`` nothing moves, so the experts run on the whole buffer directly.

The experts themselves are split Megatron-style by the user's ``expert`` module; this file has the minimum
needed, :class:`ColumnParallelLinear` (output features split; the input's gradient all-reduced) and
:class:`RowParallelLinear` (input features split; the output all-reduced, then the bias). Their split
parameters carry ``tensor_model_parallel = True`` (Megatron's attribute), which the gradient norm reads.
The ``tp`` group is handed to them by ``MoE.set_deepspeed_parallelism`` (no module globals).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import comm


@dataclass(frozen=True)
class TensorParallel:
    """This rank's tensor-parallel group, its size and its rank in it."""

    group: Any
    size: int
    rank: int


def tensor_parallel_of(mpu: Any) -> TensorParallel | None:
    """The tensor-parallel group of an ``mpu`` (Megatron's ``get_tensor_model_parallel_*`` names, which
    zerospeed's ``PipelineParallelGrid`` also serves), or None when there is none or it has one rank."""
    if mpu is None or not callable(getattr(mpu, "get_tensor_model_parallel_world_size", None)):
        return None
    size = int(mpu.get_tensor_model_parallel_world_size())
    if size == 1:
        return None
    return TensorParallel(mpu.get_tensor_model_parallel_group(), size, int(mpu.get_tensor_model_parallel_rank()))


def _gather(x: Tensor, dim: int, tp: TensorParallel) -> Tensor:
    x = x.contiguous()
    out = torch.empty((tp.size * x.numel(),), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x.reshape(-1), group=tp.group)
    return torch.cat(list(out.view(tp.size, *x.shape).unbind(0)), dim=dim)


def _drop(x: Tensor, dim: int, tp: TensorParallel) -> Tensor:
    if x.shape[dim] % tp.size:
        raise ValueError(f"expert tensor parallelism: the capacity ({x.shape[dim]}) must be divisible by the "
                         f"tensor-parallel size ({tp.size}), as in DeepSpeed (choose capacity_factor/min_capacity)")
    n = x.shape[dim] // tp.size
    return x.narrow(dim, tp.rank * n, n)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, tp: TensorParallel) -> Tensor:  # type: ignore[override]
        ctx.dim, ctx.tp = dim, tp
        return _gather(x, dim, tp)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return _drop(grad, ctx.dim, ctx.tp).contiguous(), None, None


class _DropTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, tp: TensorParallel) -> Tensor:  # type: ignore[override]
        ctx.dim, ctx.tp = dim, tp
        return _drop(x, dim, tp).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return _gather(grad, ctx.dim, ctx.tp), None, None


def gather_tokens(x: Tensor, dim: int, tp: TensorParallel | None) -> Tensor:
    """All-gather the ``tp`` ranks' slices along ``dim`` (backward: keep this rank's slice)."""
    return x if tp is None else _GatherTokens.apply(x, dim, tp)


def drop_tokens(x: Tensor, dim: int, tp: TensorParallel | None) -> Tensor:
    """Keep this ``tp`` rank's slice along ``dim`` (backward: all-gather)."""
    return x if tp is None else _DropTokens.apply(x, dim, tp)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the input's gradient all-reduced over the ``tp`` group (each rank saw a slice)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Partial sums all-reduced over the ``tp`` group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        x = x.contiguous().clone()
        comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def _split(n: int, tp_size: int, what: str) -> int:
    if tp_size < 1 or n % tp_size:
        raise ValueError(f"{what} ({n}) must be divisible by the tensor-parallel size ({tp_size})")
    return n // tp_size


class ColumnParallelLinear(nn.Module):
    """``y[:, slice] = x @ W[slice].T + b[slice]``: this rank's ``out_features // tp_size`` outputs."""

    def __init__(self, in_features: int, out_features: int, tp_size: int, bias: bool = True) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.empty(_split(out_features, tp_size, "out_features"), in_features))
        self.bias = nn.Parameter(torch.zeros(self.weight.shape[0])) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        self.tp_group: Any = None
        self.set_tensor_parallel_group(None)

    def set_tensor_parallel_group(self, group: Any) -> None:
        """Also (re)marks the split parameters: ``Experts`` deep-copies the expert, which drops the marks."""
        self.tp_group = group
        for p in self.parameters():
            p.tensor_model_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: Tensor) -> Tensor:
        if self.tp_size > 1:
            if self.tp_group is None:
                raise RuntimeError("ColumnParallelLinear has no tensor-parallel group: build the MoE layer with "
                                   "enable_expert_tensor_parallelism=True and pass the mpu to initialize()")
            x = _CopyToTP.apply(x, self.tp_group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x[:, slice] @ W[:, slice].T) + b``: input features split, the bias whole."""

    def __init__(self, in_features: int, out_features: int, tp_size: int, bias: bool = True) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.empty(out_features, _split(in_features, tp_size, "in_features")))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        self.tp_group: Any = None
        self.set_tensor_parallel_group(None)

    def set_tensor_parallel_group(self, group: Any) -> None:
        """Also (re)marks the split weight (the bias is whole on every rank)."""
        self.tp_group = group
        self.weight.tensor_model_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            if self.tp_group is None:
                raise RuntimeError("RowParallelLinear has no tensor-parallel group: build the MoE layer with "
                                   "enable_expert_tensor_parallelism=True and pass the mpu to initialize()")
            y = _ReduceFromTP.apply(y, self.tp_group)
        return y if self.bias is None else y + self.bias


def is_tensor_parallel_param(p: Tensor) -> bool:
    """Megatron's marking of a parameter split over the tensor-parallel group."""
    return bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))
