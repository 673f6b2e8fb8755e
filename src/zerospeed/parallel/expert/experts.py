"""Experts: ``num_local_experts`` copies of one expert module, each fed its own slice of the dispatched tokens."""

from __future__ import annotations

import copy

import torch
from torch import nn


def mark_expert_params(module: nn.Module, group_name: str) -> None:
    """Tag params as DeepSpeed does (``allreduce = False``, ``group_name``) so ``is_moe_param`` and
    ``split_params_into_different_moe_groups_for_optimizer`` recognise them in user code too."""
    for param in module.parameters():
        param.allreduce = False  # type: ignore[attr-defined]
        param.group_name = group_name  # type: ignore[attr-defined]


class Experts(nn.Module):
    """DeepSpeed's ``Experts(expert, num_local_experts, expert_group_name)``.

    ``forward(inputs)`` splits ``inputs`` along dim 1 into one chunk per local expert (layout
    ``[..., local expert, tokens, model]``) and concatenates the outputs back along dim 1.
    """

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            mark_expert_params(e, expert_group_name or "")

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # ignore a bias term, as DeepSpeed
        return torch.cat(outputs, dim=1)
