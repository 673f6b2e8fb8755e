"""The module cast of ``initialize()``: parameters to the compute dtype, buffers as DeepSpeed 0.19.8 does.

Floating parameters take the compute dtype (fp32, or bf16/fp16 when that precision is on). Buffers keep the
dtype they were loaded with (a rotary ``inv_freq`` stays fp32 under bf16) unless ``data_types.buffer_dtype``
names one; DeepSpeed 0.19.8 made this change from its former blanket ``module.bfloat16()``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config.data_types import DataTypesConfig


def cast_parameters(module: nn.Module, device: torch.device, compute: torch.dtype) -> None:
    """Move the module to ``device``; floating parameters to ``compute`` (buffers keep their dtype)."""
    module.to(device=device)
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != compute:
            p.data = p.data.to(compute)


@torch.no_grad()
def cast_buffers(module: nn.Module, data_types: DataTypesConfig, compute: torch.dtype) -> None:
    """``data_types``: check ``param_dtype``; cast floating buffers to ``buffer_dtype`` when it is set."""
    data_types.check_param_dtype(compute)
    target = data_types.resolved_buffer_dtype()
    if target is None:
        return
    for b in module.buffers():
        if b.is_floating_point() and b.dtype != target:
            b.data = b.data.to(target)
