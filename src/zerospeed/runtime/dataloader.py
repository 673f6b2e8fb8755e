"""The training data loader initialize() returns: one shard of the dataset per data-parallel rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def build_dataloader(dataset: Dataset, micro_batch: int, dp_rank: int, dp_size: int,
                     collate_fn: Callable[..., Any] | None = None, drop_last: bool = False,
                     seed: int = 0, shuffle: bool = True) -> DataLoader:
    """A DataLoader over a DistributedSampler (explicit rank and size; no global state)."""
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last)
