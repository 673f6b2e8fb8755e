"""``fp16.auto_cast``: cast the floating-point inputs of a forward to fp16 (DeepSpeed's ``_cast_inputs_half``).

Walks lists, tuples (named tuples keep their type) and dicts; a floating-point tensor becomes ``.half()``;
integer tensors (token ids, masks) and every other object pass through unchanged. As in DeepSpeed, only the
positional inputs are cast, keyword arguments are not.
"""

from __future__ import annotations

from typing import Any

import torch


def cast_inputs_half(value: Any) -> Any:
    """``value`` with every floating-point tensor inside it cast to fp16."""
    if isinstance(value, torch.Tensor):
        return value.half() if value.is_floating_point() else value
    if isinstance(value, tuple):
        items = [cast_inputs_half(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return type(value)(cast_inputs_half(v) for v in value)
    if isinstance(value, dict):
        return {k: cast_inputs_half(v) for k, v in value.items()}
    return value
