"""Where a bucket's reduced chunk (this rank's part) goes: the gradient partition, or the offload sink.

``PartitionDest``: this rank's reduced partition per group, in the accumulation dtype, in device memory.
It is made (uninitialised) at the first reduce of a window and released at ``zero()``, so it is not held
through the forward and the start of backward, where a step's activations peak; a bucket no reduce has
written yet reads as zeros. A reduce-scatter may write its chunk straight into it (``direct``).

``SinkDest``: no partition buffer; each chunk is handed to the offload sink (``offload/grad_sink.py``:
NVMe offload at stages 2-3 streams it to the swap files, CPU offload on an accelerator to host memory).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..accelerator.huge_pages import empty_buffer, zeros_buffer
from .sharded_group import ShardedGroup


class PartitionDest:
    in_place = True  # a single partition is its full-size bucket buffer itself

    def __init__(self, groups: Sequence[ShardedGroup], dtype: torch.dtype, count_released: bool) -> None:
        """``count_released``: ``bytes()`` counts a released partition at its size (it comes back each step)."""
        self.groups, self.dtype, self.count_released = groups, dtype, count_released
        self.partition: list[torch.Tensor | None] = [None] * len(groups)
        self.unwritten: list[set[int]] = [set() for _ in groups]  # buckets of a partition no reduce wrote yet

    def buffer(self, g: int) -> torch.Tensor:
        """Group g's reduced partition, zeros where no reduce has written."""
        grp = self.groups[g]
        part = self.partition[g]
        if part is None:
            part = self.partition[g] = zeros_buffer(grp.plan.partition_numel, self.dtype, grp.device)
        for b in self.unwritten[g]:
            bucket = grp.plan.buckets[b]
            part[bucket.partition_offset: bucket.partition_offset + bucket.shard_numel].zero_()
        self.unwritten[g] = set()
        return part

    def target(self, g: int, b: int) -> tuple[torch.Tensor, bool]:
        """Bucket b's slice of group g's partition, and whether no reduce has written it in this window."""
        grp = self.groups[g]
        if self.partition[g] is None:
            self.partition[g] = empty_buffer(grp.plan.partition_numel, self.dtype, grp.device)
            self.unwritten[g] = set(range(len(grp.plan.buckets)))
        fresh = b in self.unwritten[g]
        self.unwritten[g].discard(b)
        bucket = grp.plan.buckets[b]
        return self.partition[g][bucket.partition_offset: bucket.partition_offset + bucket.shard_numel], fresh  # type: ignore[index]

    def direct(self, g: int, b: int, replaces: bool) -> torch.Tensor | None:
        """The slice a reduce-scatter may write itself: when its chunk replaces the slice (``replaces``: the
        bucket held the whole window) or no reduce wrote it yet."""
        if replaces or self.partition[g] is None or b in self.unwritten[g]:
            return self.target(g, b)[0]
        return None

    def put(self, g: int, b: int, mine: torch.Tensor, scale: float, replaces: bool) -> None:
        target, fresh = self.target(g, b)
        if not replaces and not fresh:
            target.add_(mine, alpha=scale)  # one pass: no scaled temporary
        elif scale != 1.0:
            torch.mul(mine, scale, out=target)
        else:
            target.copy_(mine)

    def add(self, g: int, b: int, values: torch.Tensor) -> None:
        bucket = self.groups[g].plan.buckets[b]
        self.buffer(g)[bucket.partition_offset: bucket.partition_offset + bucket.shard_numel].add_(values)

    def end_micro_step(self) -> None:
        pass

    def zero(self) -> None:
        self.partition = [None] * len(self.partition)
        self.unwritten = [set() for _ in self.partition]

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from (t for t in self.partition if t is not None)

    def bytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.tensors())
        if self.count_released:
            size = torch.empty((), dtype=self.dtype).element_size()
            total += sum(grp.plan.partition_numel * size for g, grp in enumerate(self.groups)
                         if grp.num_partitions > 1 and self.partition[g] is None)
        return total


class SinkDest:
    in_place = False

    def __init__(self, groups: Sequence[ShardedGroup], sink: Any) -> None:
        self.groups, self.sink = groups, sink

    def buffer(self, g: int) -> torch.Tensor:
        raise RuntimeError("offloaded gradients are read from the offload sink (sink.partition), not the reducer")

    def direct(self, g: int, b: int, replaces: bool) -> torch.Tensor | None:
        return None

    def put(self, g: int, b: int, mine: torch.Tensor, scale: float, replaces: bool) -> None:
        self.add(g, b, mine * scale if scale != 1.0 else mine)

    def add(self, g: int, b: int, values: torch.Tensor) -> None:
        self.sink.add(g, self.groups[g].plan.buckets[b].partition_offset, values)

    def end_micro_step(self) -> None:
        self.sink.end_micro_step()

    def zero(self) -> None:
        self.sink.zero()

    def tensors(self) -> Iterator[torch.Tensor]:
        return iter(())

    def bytes(self) -> int:
        return int(self.sink.host_bytes())
