"""Stage 2's transient bucket buffers start uninitialised: gradients are copied in, and exactly the columns no
gradient lands in (each parameter's padding) are zeroed. Data and padding together cover every element once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.zero.grad_reducer import GradReducer, ReduceSettings
from zerospeed.zero.layout import scatter_into
from zerospeed.zero.sharded_group import ShardedGroup


@pytest.mark.parametrize("world", [2, 3, 4])
def test_padding_and_data_cover_each_bucket_once(world: int) -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (1, 3, 7, 8, 12, 5)]
    grp = ShardedGroup(params, {}, world, 0, bucket_numel=40, compute_dtype=torch.float32)
    settings = ReduceSettings(stage=2, dp_size=world, accum_dtype=torch.float32, comm_dtype=torch.float32)
    reducer = GradReducer([grp], settings, None)
    for b, bucket in enumerate(grp.plan.buckets):
        count = torch.zeros(world, bucket.shard_numel)
        for i in bucket.params:
            slot = grp.plan.slots[i]
            scatter_into(count, slot.offset, slot.shard, torch.ones(slot.numel), accumulate=True)
        for row, lo, hi in reducer._padding(0, b):
            count[row:, lo:hi] += 1
        # an overlap between two padding ranges is harmless (both zero); data must never be zeroed
        assert bool((count >= 1).all()), f"bucket {b}: elements neither written nor zeroed"
        data = torch.zeros_like(count)
        for i in bucket.params:
            slot = grp.plan.slots[i]
            scatter_into(data, slot.offset, slot.shard, torch.ones(slot.numel), accumulate=False)
        for row, lo, hi in reducer._padding(0, b):
            assert not bool(data[row:, lo:hi].any()), f"bucket {b}: padding range ({row}, {lo}, {hi}) holds data"
    reducer.remove_hooks()
