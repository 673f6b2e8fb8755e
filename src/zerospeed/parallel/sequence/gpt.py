"""Ulysses for zerospeed's own GPT (``models/gpt.py``): every block's core attention becomes a
``DistributedAttention`` over the sequence group. Each rank then feeds its sequence shard, with its
``position_ids``, to ``GPT.forward``."""

from __future__ import annotations

from typing import Any

from torch import nn

from .layer import DistributedAttention

__all__ = ["sequence_parallel_gpt"]


class _Core(nn.Module):
    """``(q, k, v, dropout_p)`` -> the Ulysses exchange around ``causal_attention`` (``[b, t, h, d]``)."""

    def __init__(self, attention: Any, group: Any) -> None:
        super().__init__()
        self.ulysses = DistributedAttention(attention, group, scatter_idx=2, gather_idx=1)

    def forward(self, q: Any, k: Any, v: Any, dropout_p: float = 0.0) -> Any:
        return self.ulysses(q, k, v, 0, None, dropout_p=dropout_p)


def sequence_parallel_gpt(model: nn.Module, group: Any) -> nn.Module:
    """Install Ulysses attention on every ``CausalSelfAttention`` of ``model`` (in place; returns it)."""
    from ...models.gpt import CausalSelfAttention, causal_attention

    found = 0
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.core_attention = _Core(causal_attention, group)
            found += 1
    if not found:
        raise ValueError("sequence_parallel_gpt: the model has no zerospeed.models.gpt.CausalSelfAttention")
    return model
