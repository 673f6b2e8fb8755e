"""The partition plan: which rank owns which elements of each parameter, and the bucket layout.

Pure: sizes in, plan out; no tensors, no processes.

Each parameter (flattened, ``n`` elements) is padded to ``N * s`` with ``s = ceil(n / N)`` and cut
into N equal shards: rank ``r`` owns elements ``[r*s, min((r+1)*s, n))`` (the rest is zero padding).
Parameters are grouped into buckets in reverse order (the order backward produces gradients), capped
at ``bucket_numel`` padded elements (a larger parameter gets a bucket of its own).

Range map of one rank's flat partition (``partition_numel`` elements)::

    [ bucket 0: shard(p_k) shard(p_k-1) ... | bucket 1: ... | ... ]
      ^ partition_offset(b)  ^ + slot.offset

Range map of a bucket's communication buffer (``N * S_b`` elements, rank-major)::

    [ rank 0: shards of the bucket's params | rank 1: ... | ... | rank N-1: ... ]

so a reduce-scatter of that buffer leaves each rank exactly its partition slice of the bucket, and an
all-gather of the partition slices rebuilds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSlot:
    """Where parameter ``index`` lives: its shard size, bucket, and offset within the bucket's chunk."""

    index: int
    numel: int
    shard: int
    bucket: int
    offset: int

    def owned_range(self, rank: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of the flattened parameter owned by ``rank`` (may be empty)."""
        start = min(rank * self.shard, self.numel)
        return start, min(start + self.shard, self.numel)


@dataclass(frozen=True)
class BucketPlan:
    index: int
    params: tuple[int, ...]
    shard_numel: int
    partition_offset: int


@dataclass(frozen=True)
class PartitionPlan:
    world: int
    slots: tuple[ParamSlot, ...]
    buckets: tuple[BucketPlan, ...]
    partition_numel: int

    @property
    def padded_numel(self) -> int:
        """Elements of the full (padded) flat model: world * partition_numel."""
        return self.world * self.partition_numel

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)


def shard_size(numel: int, world: int) -> int:
    return max(1, -(-numel // world))


# Stages 2-3 hold each bucket's full-size gradient buffer only while it fills and reduces (at most ``MAX_IN_FLIGHT``
# + 1 at once), so one bucket as large as the model is a second full copy of the gradients through backward.
# ``reduce_bucket_size`` is DeepSpeed's *maximum*; below it buckets are cut at 1/TRANSIENT_BUCKET_PARTS of the
# group's gradient (a larger parameter still gets one bucket of its own).
TRANSIENT_BUCKET_PARTS = 8


def reduce_bucket_numel(reduce_bucket_size: int, numels: Sequence[int], stage: int, world: int) -> int:
    """The bucket size to plan with: ``reduce_bucket_size`` on one rank (``world``: data-parallel ranks), else
    also at most 1/8 of the group's padded gradient: the transient bucket buffers of stages 2-3 stay a fraction
    of the model, and at stages 0-1 (buckets are views of the full gradient buffer, so the cut costs no memory)
    the collectives of the first buckets overlap the rest of backward, as DDP's do, instead of waiting for all
    of it (DeepSpeed's 5e8-element default puts most models in one bucket reduced after backward)."""
    if world < 2 or not numels:
        return reduce_bucket_size
    total = sum(shard_size(n, world) for n in numels) * world
    return max(1, min(reduce_bucket_size, -(-total // TRANSIENT_BUCKET_PARTS)))


def plan_partitions(numels: Sequence[int], world: int, bucket_numel: int,
                    alone: frozenset[int] = frozenset(), kinds: Sequence[int] | None = None) -> PartitionPlan:
    """Plan shards and buckets for parameters of the given sizes over ``world`` ranks (the parameters in ``alone``
    each get a bucket of their own: ``sparse_gradients`` reduces those buckets as rows). ``kinds`` (one per
    parameter): a bucket holds parameters of one kind only (its gradients travel in one dtype:
    ``torch_autocast.lower_precision_safe_modules``)."""
    if kinds is not None and len(kinds) != len(numels):
        raise ValueError(f"{len(kinds)} kinds for {len(numels)} parameters")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    for i, n in enumerate(numels):
        if n < 1:
            raise ValueError(f"parameter {i} has {n} elements; empty parameters cannot be partitioned")
    slots: dict[int, ParamSlot] = {}
    buckets: list[BucketPlan] = []
    current: list[int] = []
    current_shard = 0
    partition_offset = 0

    def close() -> None:
        nonlocal current, current_shard, partition_offset
        if current:
            buckets.append(BucketPlan(len(buckets), tuple(current), current_shard, partition_offset))
            partition_offset += current_shard
            current, current_shard = [], 0

    for index in reversed(range(len(numels))):
        s = shard_size(numels[index], world)
        other_kind = kinds is not None and bool(current) and kinds[current[-1]] != kinds[index]
        if current and ((current_shard + s) * world > bucket_numel or index in alone or current[-1] in alone
                        or other_kind):
            close()
        slots[index] = ParamSlot(index, numels[index], s, len(buckets), current_shard)
        current.append(index)
        current_shard += s
    close()
    return PartitionPlan(world, tuple(slots[i] for i in range(len(numels))), tuple(buckets), partition_offset)
