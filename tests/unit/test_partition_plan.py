"""The partition plan is pure: every element of every parameter is owned exactly once, at any world size."""

import pytest

from zerospeed.zero import plan_partitions


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("numels", [[1], [5, 3, 17], [100, 1, 64, 7, 33, 2], [1000, 999, 1001]])
def test_every_element_owned_once(world: int, numels: list[int]) -> None:
    plan = plan_partitions(numels, world, bucket_numel=64)
    for slot, n in zip(plan.slots, numels):
        owned = []
        for r in range(world):
            lo, hi = slot.owned_range(r)
            assert 0 <= lo <= hi <= n
            assert hi - lo <= slot.shard
            owned.extend(range(lo, hi))
        assert owned == list(range(n))
        assert slot.shard * world >= n > (slot.shard - 1) * world
    assert plan.partition_numel == sum(b.shard_numel for b in plan.buckets)
    assert plan.padded_numel - sum(numels) < world * len(numels)


def test_buckets_follow_backward_order_and_cap() -> None:
    plan = plan_partitions([10, 10, 10, 10], 2, bucket_numel=20)
    assert [b.params for b in plan.buckets] == [(3, 2), (1, 0)]
    offsets = [b.partition_offset for b in plan.buckets]
    assert offsets == [0, 10]
    # within a bucket, shards are laid out in bucket order
    assert plan.slots[3].offset == 0 and plan.slots[2].offset == 5


def test_oversized_parameter_gets_its_own_bucket() -> None:
    plan = plan_partitions([4, 1000, 4], 4, bucket_numel=16)
    assert [b.params for b in plan.buckets] == [(2,), (1,), (0,)]


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="world"):
        plan_partitions([4], 0, 16)
    with pytest.raises(ValueError, match="empty"):
        plan_partitions([0], 2, 16)


def test_a_bucket_holds_one_gradient_dtype() -> None:
    import torch

    from zerospeed.zero import ShardedGroup
    from zerospeed.zero.bucket_store import BucketStore

    # kinds alternate in backward order: 4 3 | 2 | 1 0 (a cap that would otherwise fit all five)
    plan = plan_partitions([2, 2, 2, 2, 2], 2, 1000, kinds=[0, 0, 1, 0, 0])
    assert [b.params for b in plan.buckets] == [(4, 3), (2,), (1, 0)]
    with pytest.raises(ValueError, match="2 kinds for 5 parameters"):
        plan_partitions([2, 2, 2, 2, 2], 2, 1000, kinds=[0, 1])
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    grp = ShardedGroup(params, {}, 2, 0, 1000, torch.float32, comm_dtypes=[None, torch.bfloat16, None])
    assert grp.bucket_comm_dtypes == (None, torch.bfloat16, None)
    store = BucketStore([grp], torch.float32, [True], reduces_every_micro_step=False, comm_dtype=torch.float16)
    assert [store.comm_dtype(0, b) for b in range(3)] == [torch.float16, torch.bfloat16, torch.float16]


def test_stale_full_buffer_copies_first_gradients_and_zeroes_the_rest_on_launch() -> None:
    """A partitioned group's full buffer is not zeroed after the step: the window's first gradient of each
    parameter is copied in, and what has no value (no gradient, padding) is zeroed before the bucket is reduced
    or a block is read. Reverting any part leaves old values in the sum."""
    import torch

    from zerospeed.zero import ShardedGroup
    from zerospeed.zero.bucket_store import BucketStore
    from zerospeed.zero.layout import scatter_into

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 3)]  # odd sizes: padding columns over 2 partitions
    grp = ShardedGroup(params, {}, 2, 0, 1000, torch.float32)
    store = BucketStore([grp], torch.float32, [True], reduces_every_micro_step=False)
    full = store.full[0]
    assert full is not None and len(grp.plan.buckets) == 1
    full.fill_(7.0)  # last step's leftovers (the reduce's scratch, the write-back's parameters)
    store.zero()
    assert store.stale[0] and bool((full == 7.0).all())  # no pass over the buffer
    width = grp.plan.buckets[0].shard_numel
    got: set = set()
    key = (0, 1)
    assert store.uninitialised(0, key, got, set())
    slot = grp.plan.slots[1]
    scatter_into(store.bucket(0, 0).view(2, width), slot.offset, slot.shard, torch.ones(3), accumulate=False)
    got.add(key)
    assert not store.uninitialised(0, key, got, set()) and not store.uninitialised(0, key, set(), {key})
    store.zero_missing(0, 0, got, set())
    view = store.bucket(0, 0).view(2, width)
    expect = torch.zeros(2, width)
    scatter_into(expect, slot.offset, slot.shard, torch.ones(3), accumulate=False)
    torch.testing.assert_close(view, expect)  # parameter 0 (no gradient) and the padding are zeros now
    full.fill_(7.0)
    store.zero()
    store.clean_block(0, 0, set(), set())  # a read before any gradient: zeros, and later gradients add
    assert not store.uninitialised(0, (0, 0), set(), set())
    s0 = grp.plan.slots[0]
    assert bool((view[:, s0.offset:s0.offset + s0.shard] == 0).all())
    one = BucketStore([ShardedGroup(params, {}, 1, 0, 1000, torch.float32)], torch.float32, [True], False)
    one.full[0].fill_(7.0)
    one.zero()  # one partition: the buffer is the reduced gradient itself, zeroed whole
    assert not one.stale[0] and bool((one.full[0] == 0).all())
