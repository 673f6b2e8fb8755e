"""``deepspeed.runtime.utils``' free-standing gradient helpers: ``clip_grad_norm_``, ``get_weight_norm``,
``get_global_norm``, ``CheckOverflow``, ``is_model_parallel_parameter``, ``count_used_parameters_in_backward``.

They act on plain lists of parameters, outside any engine (Megatron-style scripts and DeepSpeed's tests call
them); the engine's own norm and overflow verdict are the ZeRO optimizer's (``zero/optimizer.py``,
``zero/norm_axes.py``). DeepSpeed's formulas are kept:

- ``clip_grad_norm_``: the p-norm of the gradients (model-parallel ranks other than 0 count only split
  parameters; the squares are summed over the mpu's model-parallel group), then *averaged* over the
  data-parallel group (expert gradients differ between ranks, so each rank's norm differs: the mean makes
  every rank clip by the same coefficient ``min(1, max_norm / (norm + 1e-6))``); returns the norm (a tensor).
  Difference: the per-parameter p-norms are combined as ``(sum n ** p) ** (1 / p)``; DeepSpeed 0.19.8 sums
  their *squares* whatever p (``square().sum().pow(1 / p)``), which is the p-norm only for p = 2.
- ``get_weight_norm``: the p-norm of the tensors themselves, ``-1`` when not finite.
- ``CheckOverflow``: a rank's inf/NaN verdict made common with one MAX over the largest expert-parallel group
  (when expert parameters are among them, the groups of ``deepspeed.utils.groups``) and the mpu's
  model-parallel group, through zerospeed's ``comm.all_reduce_max_flag``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .. import comm
from ..parallel.expert.utils import is_moe_param
from . import groups

PIPE_REPLICATED = "ds_pipe_replicated"


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """Split over the tensor-parallel ranks (Megatron's ``model_parallel`` / ``tensor_model_parallel`` tag)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def _mp_rank(mpu: Any) -> int:
    if mpu is None:
        return 0
    for name in ("get_tensor_model_parallel_rank", "get_model_parallel_rank", "get_slice_parallel_rank"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 0


def _sum_over(t: torch.Tensor, group: Any, op: Any = comm.ReduceOp.SUM) -> torch.Tensor:
    if comm.is_initialized() and comm.get_world_size(group) > 1:
        out = t.to(comm.device_for_backend(group))
        comm.all_reduce(out, group=group, op=op)
        return out.to(t.device)
    return t


def get_global_norm(norm_list: Iterable[float]) -> float:
    """The 2-norm of norms: ``sqrt(sum(n ** 2))``."""
    return math.sqrt(sum(float(n) ** 2.0 for n in norm_list))


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2,
                    mpu: Any = None) -> torch.Tensor:
    """Clip the gradients in place by their global norm (DeepSpeed's formula: module docstring)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    norm_type = float(norm_type)
    mp_group = mpu.get_model_parallel_group() if mpu is not None else None
    device = params[0].grad.device if params else torch.device("cpu")
    if norm_type == math.inf:
        total = (torch.stack([p.grad.detach().abs().max().float() for p in params]).max() if params
                 else torch.zeros((), device=device))
        if mpu is not None:
            total = _sum_over(total, mp_group, comm.ReduceOp.MAX)
    else:
        counted = [p for p in params if mpu is None or _mp_rank(mpu) == 0 or is_model_parallel_parameter(p)]
        norms = [torch.linalg.vector_norm(p.grad.detach().float(), norm_type) for p in counted]
        total = torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), device=device)
        if mpu is not None:
            total = _sum_over(total, mp_group)
        total = total.pow(1.0 / norm_type)
    dp_group = groups._get_data_parallel_group() if comm.is_initialized() else None
    dp = comm.get_world_size(dp_group) if comm.is_initialized() else 1
    total = _sum_over(total * 1.0 / float(dp), dp_group)  # the mean over the data-parallel ranks
    coef = torch.clamp(torch.tensor([float(max_norm)], device=total.device) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.device))
    return total


def get_weight_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2,
                    mpu: Any = None) -> float:
    """The p-norm of the tensors (not their gradients); -1 when it is inf or NaN."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    mp_group = mpu.get_model_parallel_group() if mpu is not None else None
    if norm_type == math.inf:
        total = torch.tensor([max(float(p.detach().abs().max()) for p in params)], dtype=torch.float32)
        total = float(_sum_over(total, mp_group, comm.ReduceOp.MAX)[0]) if mpu is not None else float(total[0])
    else:
        acc = 0.0
        for p in params:
            if getattr(p, PIPE_REPLICATED, False):  # a tied copy another stage counts
                continue
            if _mp_rank(mpu) > 0 and not is_model_parallel_parameter(p):  # replicated over tensor ranks
                continue
            acc += float(torch.linalg.vector_norm(p.detach().float(), norm_type)) ** norm_type
        t = torch.tensor([acc], dtype=torch.float32)
        if mpu is not None:
            t = _sum_over(t, mp_group)
        total = float(t[0]) ** (1.0 / norm_type)
    return -1 if not math.isfinite(total) else total


class CheckOverflow:
    """Inf/NaN in the gradients of ``param_groups`` on any rank that shares them (module docstring)."""

    def __init__(self, param_groups: Sequence[Sequence[torch.Tensor]] | None = None, mpu: Any = None,
                 zero_reduce_scatter: bool = False, deepspeed: Any = None) -> None:
        self.mpu = mpu
        self.zero_reduce_scatter = zero_reduce_scatter
        self.deepspeed = deepspeed
        self.params: list[torch.Tensor] | None = [p for g in param_groups for p in g] if param_groups else None
        self.has_moe_params = any(is_moe_param(p) for p in self.params or [])

    def _reduce_experts(self, flag: bool) -> bool:
        return comm.all_reduce_max_flag(flag, group=groups._get_max_expert_parallel_group())

    def check_using_norm(self, norm_group: Sequence[float], reduce_overflow: bool = True) -> bool:
        """Overflow from norms already taken (``-1`` marks a non-finite one, as ``get_weight_norm`` writes)."""
        overflow = -1 in list(norm_group)
        if self.has_moe_params:
            overflow = self._reduce_experts(overflow)
        if self.mpu is not None:
            overflow = comm.all_reduce_max_flag(overflow, group=self.mpu.get_model_parallel_group())
        elif reduce_overflow:
            overflow = comm.all_reduce_max_flag(overflow)
        return bool(overflow)

    def check(self, param_groups: Sequence[Sequence[torch.Tensor]] | None = None) -> bool:
        if param_groups is None:
            return self.has_overflow(self.params or [], has_moe_params=self.has_moe_params)
        params = [p for g in param_groups for p in g]
        return self.has_overflow(params, has_moe_params=any(is_moe_param(p) for p in params))

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        return any(p.grad is not None and self._has_inf_or_nan(p.grad.data, i) for i, p in enumerate(params))

    def has_overflow(self, params: Iterable[torch.Tensor], has_moe_params: bool | None = None) -> bool:
        """This rank's verdict, made common over the expert group (expert params), then the world (ZeRO's
        reduce-scatter, or an engine that does not all-reduce in backward) or the mpu's groups."""
        moe = self.has_moe_params if has_moe_params is None else has_moe_params
        overflow = self.has_overflow_serial(params)
        if moe:
            overflow = self._reduce_experts(overflow)
        no_backward_allreduce = self.deepspeed is not None and not getattr(
            self.deepspeed, "pipeline_enable_backward_allreduce",
            getattr(self.deepspeed, "enable_backward_allreduce", True))
        if self.zero_reduce_scatter:
            overflow = comm.all_reduce_max_flag(overflow)
        elif self.mpu is not None:
            if no_backward_allreduce:
                overflow = comm.all_reduce_max_flag(overflow, group=self.mpu.get_data_parallel_group())
            overflow = comm.all_reduce_max_flag(overflow, group=self.mpu.get_model_parallel_group())
        elif no_backward_allreduce:
            overflow = comm.all_reduce_max_flag(overflow)
        return bool(overflow)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor, i: int | None = None) -> bool:
        return not bool(torch.isfinite(x).all())


def count_used_parameters_in_backward(parameters: Sequence[torch.Tensor]) -> int:
    """How many of ``parameters`` the running backward pass reaches (call it from a backward hook): each
    distinct gradient accumulator of a parameter that requires grad, asked whether autograd will run it."""
    lookup = getattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc", None)
    will_run = getattr(torch._C, "_will_engine_execute_node", None)
    if lookup is None or will_run is None or not hasattr(torch._C, "_current_graph_task_id"):
        raise NotImplementedError("count_used_parameters_in_backward needs torch.autograd.graph."
                                  "_get_grad_fn_or_grad_acc and torch._C._will_engine_execute_node")
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward execution")
    nodes: dict[int, Any] = {}
    for p in parameters:
        if isinstance(p, torch.Tensor) and p.requires_grad:
            with torch.enable_grad():  # backward hooks run without grad mode; the leaf lookup needs it
                node = lookup(p)
            if node is not None:
                nodes.setdefault(id(node), node)
    return sum(int(will_run(n)) for n in nodes.values())


__all__ = ["CheckOverflow", "clip_grad_norm_", "count_used_parameters_in_backward", "get_global_norm",
           "get_weight_norm", "is_model_parallel_parameter"]
