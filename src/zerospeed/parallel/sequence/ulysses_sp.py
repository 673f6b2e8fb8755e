"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp`` (Arctic Long Sequence Training) names,
re-exported from where they live: Ulysses for Hugging Face models, the sequence-sharding data loader, and
tiled compute (``tiled.py``, ``tiled_loss.py``)."""

from .hf import UlyssesSPAttentionHF
from .layer import DistributedAttention
from .loader import UlyssesSPDataLoaderAdapter, sequence_mean_loss
from .tiled import SequenceTiledCompute, TiledMLP, sequence_tiled_compute
from .tiled_loss import TiledFusedLogitsLoss

__all__ = ["DistributedAttention", "SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP",
           "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_mean_loss", "sequence_tiled_compute"]
