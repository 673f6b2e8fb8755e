"""``data_types``: DeepSpeed's dtype overrides of the module cast (``param_dtype``, ``buffer_dtype``).

As in DeepSpeed 0.19.8, ``initialize()`` casts the parameters to the precision mode's dtype (bf16/fp16)
and leaves the buffers (rotary ``inv_freq``, norm statistics) at the dtype they were loaded with, unless
``buffer_dtype`` names one. ``param_dtype`` may only restate the precision mode's dtype (DeepSpeed
asserts it). ``grad_accum_dtype`` names the dtype of the gradient buffers (accumulation over micro-steps,
reduction, partition); unset, zerospeed accumulates fp32 and bf16 models in fp32 and fp16 models in fp16
(DeepSpeed's unset value is the model's dtype: bf16 for a bf16 model; set ``"bf16"`` for its numerics).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import field_validator

from .base import Section

# DeepSpeed's DtypeEnum spellings.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "torch.float32": torch.float32,
}


class DataTypesConfig(Section):
    """``data_types``: which dtype the module's parameters and buffers are cast to by ``initialize()``."""

    param_dtype: str | None = None
    """Must equal the precision mode's dtype (fp16 / bf16 enabled, else fp32); None: follow it."""
    buffer_dtype: str | None = None
    """None (DeepSpeed's default): floating buffers keep their dtype; else every floating buffer is cast to it."""
    grad_accum_dtype: str | None = None
    """The gradient buffers' dtype; None: fp32 for fp32 and bf16 models, fp16 for fp16 ones."""

    @field_validator("param_dtype", "buffer_dtype", "grad_accum_dtype")
    @classmethod
    def _known(cls, v: Any) -> Any:
        if v is not None and str(v).lower() not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {v!r}; use one of fp32, fp16, bf16")
        return v

    def resolved_grad_accum_dtype(self) -> torch.dtype | None:
        return None if self.grad_accum_dtype is None else DTYPE_NAMES[self.grad_accum_dtype.lower()]

    def resolved_buffer_dtype(self) -> torch.dtype | None:
        return None if self.buffer_dtype is None else DTYPE_NAMES[self.buffer_dtype.lower()]

    def check_param_dtype(self, compute: torch.dtype) -> None:
        """DeepSpeed's rule: ``param_dtype`` restates the precision mode, it does not choose one."""
        from .errors import ConfigError

        if self.param_dtype is not None and DTYPE_NAMES[self.param_dtype.lower()] != compute:
            raise ConfigError("data_types.param_dtype", f"{self.param_dtype!r} conflicts with the enabled precision "
                              f"mode (model dtype {compute}); set the matching fp16/bf16 'enabled' flag or omit "
                              "data_types.param_dtype (as in DeepSpeed)")
