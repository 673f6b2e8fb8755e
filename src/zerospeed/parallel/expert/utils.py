"""DeepSpeed's MoE parameter helpers: which params are experts', and optimizer groups that keep them apart."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(True, num_experts of the first MoE layer) when ``m`` holds an MoE layer."""
    from .layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """An expert's parameter (tagged ``allreduce = False`` by ``Experts``)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params: list[nn.Parameter]) -> tuple[list[nn.Parameter],
                                                                                   list[nn.Parameter]]:
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(group: list[nn.Parameter]) -> tuple[list[torch.Tensor],
                                                                                         list[torch.Tensor]]:
    shared = [p.grad.to(p.dtype) for p in group if p.grad is not None and not is_moe_param(p)]
    return shared, [p.grad.to(p.dtype) for p in group if p.grad is not None and is_moe_param(p)]


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | float | None
                                                         = 178956971) -> list[dict[str, Any]]:
    """DeepSpeed's split: expert params leave each group for a copy of it with ``name`` = the expert group
    name and ``moe: True`` (one per expert group name, cut at ``max_group_size`` elements); every input
    group needs a ``name``."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    names = sorted({p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)})
    moe: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for g in param_groups:
        if "name" not in g:
            raise ValueError("split_params_into_different_moe_groups_for_optimizer: every param group needs a "
                             "'name' (as in DeepSpeed)")
        for key in names:
            moe[g["name"]][key] = {**g, "name": key, "moe": True, "params": []}
    for g in param_groups:
        kept = []
        for p in g["params"]:
            if is_moe_param(p):
                moe[g["name"]][p.group_name]["params"].append(p)
            else:
                kept.append(p)
        g["params"] = kept
    for by_name in moe.values():
        for g in by_name.values():
            if max_group_size is None:
                param_groups.append(g)
                continue
            chunks: list[list[nn.Parameter]] = []
            cur: list[nn.Parameter] = []
            size = 0
            for p in g["params"]:
                if size + p.numel() <= max_group_size:
                    cur.append(p)
                    size += p.numel()
                else:
                    chunks.append(cur)
                    cur, size = [p], p.numel()
            if cur:
                chunks.append(cur)
            param_groups.extend({**g, "params": c} for c in chunks)
    return param_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """Plain params -> a 'dense-params' group split as above; groups without 'moe' keys get split too."""
    if not isinstance(model_parameters, list):
        raise ValueError("model_parameters must be a list")
    first = model_parameters[0]
    if isinstance(first, nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                     "name": "dense-params"})
    if not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
