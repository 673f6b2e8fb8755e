"""Mixed-precision policy: which dtype computes, accumulates gradients, communicates, and is the master."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_COMM = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """compute: model params and activations; accum: gradient buffers; comm: gradient collectives.

    Master weights and optimizer state are always fp32. fp32 compute keeps no separate master copy
    at stage 0 (the optimizer steps the model's own parameters).
    """

    compute: torch.dtype
    accum: torch.dtype
    comm: torch.dtype
    autocast: torch.dtype | None = None  # torch_autocast: the forward's autocast dtype (params stay ``compute``)

    @property
    def mixed(self) -> bool:
        return self.compute != torch.float32

    @property
    def uses_loss_scaling(self) -> bool:
        return self.compute == torch.float16 or self.autocast == torch.float16


def make_policy(fp16: bool, bf16: bool, communication_data_type: str | None,
                autocast: torch.dtype | None = None) -> PrecisionPolicy:
    if fp16 and bf16:
        raise ValueError("fp16 and bf16 cannot both be enabled")
    if fp16:
        compute, accum = torch.float16, torch.float16
    elif bf16:
        compute, accum = torch.bfloat16, torch.float32
    else:
        compute, accum = torch.float32, torch.float32
    comm = _COMM[communication_data_type] if communication_data_type else accum
    return PrecisionPolicy(compute, accum, comm, autocast)
