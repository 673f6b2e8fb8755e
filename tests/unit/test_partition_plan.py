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
