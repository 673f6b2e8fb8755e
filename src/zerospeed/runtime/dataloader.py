"""The training data loader initialize() returns: one shard of the dataset per data-parallel rank.

It can say where it is (``state_dict``: epoch and samples consumed in the epoch, counted over all ranks)
and resume there (``load_state_dict``), also at another world size: ``DistributedSampler`` deals the
epoch's permutation round-robin, so after ``b`` batches on each of ``W`` ranks the first ``b*B*W`` samples
of the permutation are consumed, and ``W'`` ranks resume by each skipping ``b*B*W / W'`` of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ResumableSampler(DistributedSampler):
    """A DistributedSampler whose next epoch can start part-way (``skip`` of this rank's indices)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip)


class CheckpointableDataLoader(DataLoader):
    """A DataLoader that counts the batches it yielded in the current pass, for checkpoints."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches_in_epoch = 0
        self._resume_batches = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self.batches_in_epoch, self._resume_batches = self._resume_batches, 0
        for batch in super().__iter__():
            self.batches_in_epoch += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        return {"epoch": int(sampler.epoch),
                "samples_in_epoch": self.batches_in_epoch * int(self.batch_size or 1) * sampler.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        sampler.set_epoch(int(state["epoch"]))
        per_rank = int(state["samples_in_epoch"]) // sampler.num_replicas
        sampler.skip = per_rank
        self._resume_batches = per_rank // int(self.batch_size or 1)


def build_dataloader(dataset: Dataset, micro_batch: int, dp_rank: int, dp_size: int,
                     collate_fn: Callable[..., Any] | None = None, drop_last: bool = False,
                     seed: int = 0, shuffle: bool = True) -> CheckpointableDataLoader:
    """A DataLoader over a DistributedSampler (explicit rank and size; no global state)."""
    sampler = ResumableSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)
    return CheckpointableDataLoader(dataset, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn,
                                    drop_last=drop_last)
