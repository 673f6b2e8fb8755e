"""``deepspeed.runtime.utils``' ``PartitionedTensor`` and ``prefix_sum_inc``.

A ``PartitionedTensor`` keeps this rank's contiguous slice of a tensor that every rank of ``group`` holds
whole (flattened, cut by zerospeed's ``partition_uniform``: the first ``numel % world`` ranks get one element
more), and rebuilds the whole tensor with one all-gather (``full()``). ``to_meta()`` / ``from_meta()`` carry
the shape and the cut as one int64 tensor (shape rank, shape, parts, boundaries), so a receiver that got a
slice and its meta can rebuild it, as DeepSpeed's pipeline does with partitioned activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import comm
from ..parallel.pipeline.partition import partition_uniform


def prefix_sum_inc(weights: Sequence[float]) -> list[float]:
    """Inclusive prefix sums: ``[w0, w0 + w1, ...]``."""
    sums: list[float] = []
    for w in weights:
        sums.append(w + (sums[-1] if sums else 0))
    return sums


class PartitionedTensor:
    """This rank's slice of a tensor partitioned over ``group``; ``full()`` gathers it back (collective)."""

    def __init__(self, tensor: torch.Tensor | None, group: Any, partition_meta: Any = None) -> None:
        self.group = group
        self.num_parts = comm.get_world_size(group) if comm.is_initialized() else 1
        self.rank = comm.get_rank(group) if comm.is_initialized() else 0
        if tensor is None:  # from_meta fills the fields in
            return
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        lo, hi = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().reshape(-1)[lo:hi].clone()

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: Any,
                  device: Any = None) -> PartitionedTensor:
        """Rebuild the partition description from ``to_meta()`` around a received ``local_part``."""
        part = cls(tensor=None, group=group)
        values = [int(v) for v in meta.tolist()]
        ndims = values[0]
        part.orig_size = values[1:1 + ndims]
        num_parts = values[1 + ndims]
        part.partition = values[2 + ndims:3 + ndims + num_parts]
        if num_parts != part.num_parts:
            raise ValueError(f"meta describes {num_parts} parts, the group has {part.num_parts} ranks")
        part.local_data = local_part
        part.orig_device = local_part.device if device is None else torch.device(device)
        return part

    def to_meta(self) -> torch.Tensor:
        """Shape rank, shape, number of parts and the part boundaries, as one int64 tensor."""
        values = [len(self.orig_size), *self.orig_size, self.num_parts, *self.partition]
        return torch.tensor(values, dtype=torch.long, device=self.local_data.device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full(self, device: Any = None) -> torch.Tensor:
        """The whole tensor, on every rank of the group (one all-gather of equal-size padded slices)."""
        width = max(b - a for a, b in zip(self.partition, self.partition[1:]))
        padded = torch.zeros(width, dtype=self.local_data.dtype, device=self.local_data.device)
        padded[: self.local_data.numel()].copy_(self.local_data.reshape(-1))
        gathered = torch.empty(width * self.num_parts, dtype=padded.dtype, device=padded.device)
        comm.all_gather(gathered, padded, group=self.group)
        pieces = [gathered[r * width: r * width + (b - a)]
                  for r, (a, b) in enumerate(zip(self.partition, self.partition[1:]))]
        out = torch.cat(pieces).view(self.orig_size)
        return out if device is None else out.to(device)


__all__ = ["PartitionedTensor", "prefix_sum_inc"]
