"""Stage 2's transient bucket buffers start uninitialised: gradients are copied in, and exactly the columns no
gradient lands in (each parameter's padding, ``layout.padding_ranges``) are zeroed. Data and padding together
cover every element of each bucket, and no padding range holds data."""

from __future__ import annotations

import pytest
import torch

from zerospeed.zero.layout import padding_ranges, scatter_into
from zerospeed.zero.partition import plan_partitions


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_padding_and_data_cover_each_bucket(world: int) -> None:
    plan = plan_partitions([1, 3, 7, 8, 12, 5], world, bucket_numel=40)
    for bucket in plan.buckets:
        slots = [plan.slots[i] for i in bucket.params]
        data = torch.zeros(world, bucket.shard_numel)
        for slot in slots:
            scatter_into(data, slot.offset, slot.shard, torch.ones(slot.numel), accumulate=True)
        assert int(data.sum()) == sum(s.numel for s in slots) and float(data.max()) == 1.0
        pads = padding_ranges(slots, world)
        covered = data.clone()
        for row, lo, hi in pads:
            assert not bool(data[row:, lo:hi].any()), f"bucket {bucket.index}: padding ({row}, {lo}, {hi}) holds data"
            covered[row:, lo:hi] = 1
        assert bool((covered == 1).all()), f"bucket {bucket.index}: elements neither written nor zeroed"
