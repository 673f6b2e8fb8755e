"""Sequence parallelism: DeepSpeed-Ulysses attention over a sequence group, its (data, sequence) grid, and
the Hugging Face integration (Arctic Long Sequence Training: ``ulysses_sp``)."""

from .all_to_all import HeadPlan, SeqAllToAll, all_to_all_seq_heads, head_to_seq, plan_heads, seq_to_head
from .groups import SequenceParallelGrid, initialize_sequence_parallel, sequence_topology
from .layer import DistributedAttention
from .loader import UlyssesSPDataLoaderAdapter, sequence_mean_loss

__all__ = ["DistributedAttention", "HeadPlan", "SeqAllToAll", "SequenceParallelGrid", "UlyssesSPDataLoaderAdapter",
           "all_to_all_seq_heads", "head_to_seq", "initialize_sequence_parallel", "plan_heads", "seq_to_head",
           "sequence_mean_loss", "sequence_topology"]
