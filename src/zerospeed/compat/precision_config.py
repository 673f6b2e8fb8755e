"""``deepspeed.runtime.precision_config``: DeepSpeed's fp16/bf16 config classes are zerospeed's sections."""

from __future__ import annotations

from typing import Any

from ..config.precision import Bf16Config, Fp16Config

DeepSpeedFP16Config = Fp16Config
DeepSpeedBF16Config = Bf16Config
FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # DeepSpeed still reads the old section name


def get_float16_config(param_dict: dict[str, Any]) -> Fp16Config:
    """The ``fp16`` section of a config dict, validated (defaults when absent)."""
    return Fp16Config(**param_dict.get(FP16, {}))


def get_bfloat16_config(param_dict: dict[str, Any]) -> Bf16Config:
    """The ``bf16`` section (or its old name ``bfloat16``) of a config dict, validated."""
    section = param_dict.get(BFLOAT16)
    return Bf16Config(**(section if section is not None else param_dict.get(BFLOAT16_OLD, {})))


__all__ = ["BFLOAT16", "BFLOAT16_OLD", "DeepSpeedBF16Config", "DeepSpeedFP16Config", "FP16", "get_bfloat16_config",
           "get_float16_config"]
