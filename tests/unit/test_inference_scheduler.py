"""Block allocator and Dynamic SplitFuse scheduler: pure bookkeeping, no model."""

import pytest

from zerospeed.inference.kv_cache import BlockAllocator, KVCacheOutOfBlocks, PagedKVCache, blocks_needed
from zerospeed.inference.scheduler import Limits, Scheduler


def test_allocator_hands_out_and_takes_back():
    a = BlockAllocator(4)
    x = a.allocate(3)
    assert sorted(x) == [0, 1, 2] and a.num_free == 1
    with pytest.raises(KVCacheOutOfBlocks, match="asked for 2"):
        a.allocate(2)
    a.free(x[:2])
    assert a.num_free == 3 and len(set(a.allocate(3))) == 3
    with pytest.raises(ValueError, match="double free"):
        a.free([x[2], x[2]])


def test_slots_follow_the_block_table():
    cache = PagedKVCache(1, 4, 3, 1, 2, dtype=__import__("torch").float32)
    assert cache.slots((2, 0), 0, 5).tolist() == [6, 7, 8, 0, 1]
    with pytest.raises(ValueError, match="cannot hold"):
        cache.slots((2,), 0, 4)
    assert blocks_needed(7, 3) == 3 and blocks_needed(6, 3) == 2


def _run(s: Scheduler, steps: int = 100):
    plans = []
    for _ in range(steps):
        work = s.schedule()
        if not work:
            break
        plans.append([(w.uid, w.start, w.length, w.samples) for w in work])
        s.commit(work)
        for w in work:
            seq = s.running[w.uid]
            if seq.generated == seq.max_new_tokens:
                s.finish(w.uid)
    return plans


def test_split_fuse_budget_decodes_first_and_prompts_split():
    s = Scheduler(Limits(max_ragged_batch_size=8, max_ragged_sequence_count=4), BlockAllocator(64), block_size=4)
    s.add(0, prompt_len=3, max_new_tokens=3)
    s.add(1, prompt_len=10, max_new_tokens=2)
    plans = _run(s)
    assert plans[0] == [(0, 0, 3, True), (1, 0, 5, False)]  # seq 1's prompt split at the 8-token budget
    assert plans[1] == [(0, 3, 1, True), (1, 5, 5, True)]  # decode first, then the rest of the prompt
    assert plans[2] == [(0, 4, 1, True), (1, 10, 1, True)]
    assert len(plans) == 3 and s.idle and s.allocator.num_free == 64
    assert all(sum(n for _, _, n, _ in p) <= 8 for p in plans)


def test_sequence_count_limit_and_fifo_admission():
    s = Scheduler(Limits(max_ragged_batch_size=100, max_ragged_sequence_count=2, max_tracked_sequences=3),
                  BlockAllocator(64), block_size=4)
    for uid in range(5):
        s.add(uid, prompt_len=2, max_new_tokens=1)
    work = s.schedule()
    assert [w.uid for w in work] == [0, 1] and list(s.running) == [0, 1, 2] and len(s.waiting) == 2


def test_kv_reservation_admits_only_what_fits_and_cancel_frees():
    s = Scheduler(Limits(max_ragged_batch_size=4), BlockAllocator(5), block_size=4)
    s.add(0, prompt_len=6, max_new_tokens=6)  # 12 tokens -> 3 blocks reserved
    s.add(1, prompt_len=4, max_new_tokens=4)  # 8 tokens -> 2 blocks: fits beside seq 0
    s.add(2, prompt_len=2, max_new_tokens=2)  # 1 block: must wait
    work = s.schedule()
    assert list(s.running) == [0, 1] and [w.uid for w in work] == [0]  # 4-token budget all used by seq 0's chunk
    assert len(s.running[0].blocks) == 1
    s.commit(work)
    s.finish(0)  # cancel mid-prefill
    assert s.allocator.num_free == 5
    work = s.schedule()
    assert list(s.running) == [1, 2] and [w.uid for w in work] == [1]
    with pytest.raises(ValueError, match="max_context"):
        Scheduler(Limits(max_context=8), BlockAllocator(8), 4).add(9, 6, 3)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(7, prompt_len=30, max_new_tokens=1)
    s.finish(2)
    s.finish(1)
    assert s.idle and s.allocator.num_free == 5
    with pytest.raises(KeyError):
        s.finish(1)


def test_decodes_come_first_sorted_by_length():
    """The decodes of a step are ordered by cached length (the attention's length groups are then consecutive
    rows), before the prompt chunks."""
    s = Scheduler(Limits(max_ragged_batch_size=40, max_ragged_sequence_count=3), BlockAllocator(64), block_size=4)
    for uid, n in enumerate((9, 3, 6, 2)):
        s.add(uid, prompt_len=n, max_new_tokens=4)
    s.commit(s.schedule())  # prompts 0-2 (the sequence count limit)
    work = s.schedule()  # decodes of 0, 1, 2 by length: 1 (3), 2 (6), 0 (9)
    assert [(w.uid, w.start, w.length) for w in work] == [(1, 3, 1), (2, 6, 1), (0, 9, 1)]
    s.commit(work)
    s.finish(1)
    work = s.schedule()  # seq 1 gone: the decodes of 2 and 0, then seq 3's prompt
    assert [(w.uid, w.start, w.length) for w in work] == [(2, 7, 1), (0, 10, 1), (3, 0, 2)]


def test_slot_runs_and_long_tensor_match_the_plain_forms():
    import torch

    from zerospeed.inference.kv_cache import SeqChunk, long_tensor

    cache = PagedKVCache(1, 12, 4, 1, 2, dtype=torch.float32)
    table = (7, 2, 9, 0, 5)
    for start, length in ((0, 17), (3, 1), (3, 9), (4, 4), (6, 13), (19, 1)):
        want = cache.slots(table, start, start + length).tolist()
        assert cache._slot_list(SeqChunk(table, start, length)) == want
    with pytest.raises(ValueError, match="cannot hold"):
        cache._slot_list(SeqChunk(table[:2], 6, 3))
    xs = [5, -1, 2**40, 0]
    assert torch.equal(long_tensor(xs), torch.tensor(xs)) and long_tensor(xs).dtype == torch.long
    assert long_tensor([]).shape == (0,)
