"""Full (unsplit) weights of an AutoTP model, in the original model's layout (Hugging Face ``Conv1D``: ``[in, out]``).

``full_state_dict(model)`` is collective over the tensor-parallel group (each split layer all-gathers its
shards); ``unsplit(shards, spec, transposed)`` is the pure, group-free form the checkpoint export uses.
"""

from __future__ import annotations

import torch
from torch import nn

from .model_init import tp_state


def unsplit(shards: list[torch.Tensor], spec: object, transposed: bool) -> torch.Tensor:
    """The full tensor from every tensor-parallel rank's shard, transposed back when the model stored it so."""
    from .partition import unshard

    full = unshard(shards, spec)  # type: ignore[arg-type]
    return full.t().contiguous() if transposed else full


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every split parameter whole (collective over the tensor-parallel group)."""
    from .layer import TensorParallelLayer

    state = tp_state(model)
    out = {k: v.detach() for k, v in model.state_dict().items()}
    if state is None:
        return out
    for prefix, mod in model.named_modules():
        if not isinstance(mod, TensorParallelLayer):
            continue
        for attr, full in mod.gathered_parameters().items():
            name = f"{prefix}.{attr}" if prefix else attr
            out[name] = full.t().contiguous() if name in state.transposed else full
    return out
