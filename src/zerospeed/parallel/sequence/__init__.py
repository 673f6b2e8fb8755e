"""Sequence parallelism: DeepSpeed-Ulysses attention over a sequence group, its groups, and the Hugging Face
integration (Arctic Long Sequence Training)."""

from .all_to_all import HeadPlan, SeqAllToAll, all_to_all_seq_heads, head_to_seq, plan_heads, seq_to_head
from .layer import DistributedAttention

__all__ = ["DistributedAttention", "HeadPlan", "SeqAllToAll", "all_to_all_seq_heads", "head_to_seq", "plan_heads",
           "seq_to_head"]
