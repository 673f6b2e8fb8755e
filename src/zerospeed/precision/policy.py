"""Mixed-precision policy: which dtype computes, accumulates gradients, communicates, and is the master."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_COMM = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """compute: model params and activations; accum: gradient buffers; comm: gradient collectives;
    master: the optimizer's copy of the weights; states: offloaded optimizer state (on the device the torch
    optimizer makes its state in the master's dtype).

    Master weights and optimizer state are fp32 unless ``*_master_weights_and_grads`` (then the master and the
    gradient buffers are 16-bit) and ``bf16_optimizer_states``. fp32 compute keeps no separate master copy at
    stage 0 (the optimizer steps the model's own parameters).
    """

    compute: torch.dtype
    accum: torch.dtype
    comm: torch.dtype
    autocast: torch.dtype | None = None  # torch_autocast: the forward's autocast dtype (params stay ``compute``)
    master: torch.dtype = torch.float32
    states: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.compute != torch.float32

    @property
    def uses_loss_scaling(self) -> bool:
        return self.compute == torch.float16 or self.autocast == torch.float16


def make_policy(fp16: bool, bf16: bool, communication_data_type: str | None, autocast: torch.dtype | None = None,
                master16: bool = False, states16: bool = False, grad_accum: torch.dtype | None = None) -> PrecisionPolicy:
    """``master16``: the master (and so the gradient buffers) in the compute dtype; ``states16``: offloaded
    optimizer state in bf16 too; ``grad_accum`` (``data_types.grad_accum_dtype``): the gradient buffers' dtype."""
    if fp16 and bf16:
        raise ValueError("fp16 and bf16 cannot both be enabled")
    if fp16:
        compute, accum = torch.float16, torch.float16
    elif bf16:
        compute, accum = torch.bfloat16, torch.float32
    else:
        compute, accum = torch.float32, torch.float32
    master = compute if master16 else torch.float32
    accum = master if master16 else grad_accum or accum  # DeepSpeed: "master weights and grads" share the dtype
    comm = _COMM[communication_data_type] if communication_data_type else accum
    return PrecisionPolicy(compute, accum, comm, autocast, master, torch.bfloat16 if states16 else torch.float32)
