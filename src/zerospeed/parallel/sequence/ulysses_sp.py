"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp`` (Arctic Long Sequence Training) names,
re-exported from where they live: Ulysses for Hugging Face models and the sequence-sharding data loader."""

from .hf import UlyssesSPAttentionHF
from .layer import DistributedAttention
from .loader import UlyssesSPDataLoaderAdapter, sequence_mean_loss

__all__ = ["DistributedAttention", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_mean_loss"]
