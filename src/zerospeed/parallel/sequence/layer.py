"""DeepSpeed-Ulysses attention: local attention over all positions of a subset of heads.

Each rank of the sequence group holds ``s/P`` positions of query, key and value. One all-to-all each turns
them into all ``s`` positions of the rank's heads, the local attention runs unchanged on those heads, and
one more all-to-all returns the output to ``s/P`` positions of all heads. Backward is the same exchanges
in reverse (``all_to_all.SeqAllToAll``). Heads split as ``all_to_all.plan_heads`` decides: uneven counts
(7 heads on 2 ranks: 4 + 3) and GQA (query heads follow their key/value head; key/value heads repeated
when the group is larger than their number).

Layouts, as DeepSpeed's ``DistributedAttention`` (heads always at dim 2, ``scatter_idx=2``):

* seq-first ``[s/P, b, h, d]``: ``gather_idx=0``, ``batch_dim_idx=1``
* batch-first ``[b, s/P, h, d]``: ``batch_dim_idx=0`` (the sequence is the dim that is not the batch)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...config.errors import NotSupportedYetError
from ... import comm
from .all_to_all import HeadPlan, all_to_all_seq_heads, plan_heads

__all__ = ["DistributedAttention"]


class DistributedAttention(nn.Module):
    """``DistributedAttention(local_attention, sequence_process_group, scatter_idx=2, gather_idx=0,
    num_kv_heads=None)`` as in ``deepspeed.sequence.layer``.

    ``local_attention(q, k, v, *args, **kwargs)`` receives the rank's heads over the whole sequence in the
    caller's layout; under GQA ``k``/``v`` carry fewer heads than ``q`` (as ``scaled_dot_product_attention``
    with ``enable_gqa=True`` expects). ``num_kv_heads``: the key/value head count before sharding (default:
    read off ``key`` each call).
    """

    def __init__(self, local_attention: nn.Module | Any, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None, num_kv_heads: int | None = None) -> None:
        super().__init__()
        if scatter_idx != 2:
            raise ValueError(f"DistributedAttention: heads must be at dim 2 (scatter_idx=2), got scatter_idx="
                             f"{scatter_idx}")
        if gather_idx not in (0, 1):
            raise ValueError(f"DistributedAttention: the sequence is at dim 0 or 1 (gather_idx), got {gather_idx}")
        if sp_stream is not None:
            raise NotSupportedYetError("sp_stream", "overlapping the Ulysses all-to-alls on a side stream "
                                       "(sp_stream) is not supported yet by zerospeed; pass sp_stream=None")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.num_kv_heads = num_kv_heads

    def plan(self, q_heads: int, kv_heads: int) -> HeadPlan:
        """The head split for one call (``plan_heads`` over this group's size)."""
        return plan_heads(q_heads, kv_heads, comm.get_world_size(self.spg))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int | None = None,
                rotary_pos_emb: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``[s/P, b, h, d]`` (or ``[b, s/P, h, d]`` with ``batch_dim_idx=0``) in, same layout out."""
        if rotary_pos_emb is not None:
            raise NotSupportedYetError("rotary_pos_emb", "DistributedAttention(rotary_pos_emb=...) is not supported "
                                       "yet by zerospeed: apply rotary embeddings in local_attention")
        if batch_dim_idx is None:
            batch_dim_idx = 1 - self.gather_idx
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx must be 0 or 1, got {batch_dim_idx}")
        seq_dim, head_dim = 1 - batch_dim_idx, self.scatter_idx
        kv_heads = self.num_kv_heads if self.num_kv_heads is not None else key.shape[head_dim]
        if key.shape[head_dim] != kv_heads or value.shape[head_dim] != kv_heads:
            raise ValueError(f"key/value have {key.shape[head_dim]}/{value.shape[head_dim]} heads, num_kv_heads is "
                             f"{kv_heads}")
        plan = self.plan(query.shape[head_dim], kv_heads)
        if plan.kv_repeat > 1:  # fewer key/value heads than ranks: each rank gets one (repeated) head
            key = key.repeat_interleave(plan.kv_repeat, dim=head_dim)
            value = value.repeat_interleave(plan.kv_repeat, dim=head_dim)
        q = all_to_all_seq_heads(query, self.spg, seq_dim, head_dim, plan.q_splits)
        k = all_to_all_seq_heads(key, self.spg, seq_dim, head_dim, plan.kv_splits)
        v = all_to_all_seq_heads(value, self.spg, seq_dim, head_dim, plan.kv_splits)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return all_to_all_seq_heads(context, self.spg, seq_dim, head_dim, plan.q_splits, to_heads=False)
