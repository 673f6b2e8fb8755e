"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp`` names (Arctic Long Sequence Training),
re-exported from where they live."""

from .layer import DistributedAttention

__all__ = ["DistributedAttention"]
