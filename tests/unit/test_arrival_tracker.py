"""The reducer's arrival bookkeeping (zero/arrival.py), tier 0: no tensors, no processes."""

from __future__ import annotations

from zerospeed.zero.arrival import ArrivalTracker


def _tracker() -> ArrivalTracker:
    # group 0: buckets [0, 1] and [2]; group 1: bucket [0, 1]; launched group 1 first
    return ArrivalTracker([[[0, 1], [2]], [[0, 1]]], group_order=[1, 0])


def test_buckets_launch_in_order_once_complete() -> None:
    t = _tracker()
    assert t.order == [(1, 0), (0, 0), (0, 1)]
    t.begin()
    assert t.take((0, 2))  # bucket (0, 1) is complete ...
    assert t.pop_ready() is None  # ... but (1, 0) launches first
    assert not t.take((1, 0)) and t.take((1, 1))  # completes the first bucket
    assert t.pop_ready() == 0 and t.pop_ready() is None  # (0, 0) still waits for its parameters
    assert t.launched((1, 0)) and not t.launched((0, 2))
    t.take((0, 0))
    assert t.take((0, 1))
    assert [t.pop_ready(), t.pop_ready(), t.pop_ready()] == [1, 2, None]
    assert t.pop_next() is None


def test_unused_parameters_stop_holding_their_bucket_until_readmitted() -> None:
    t = _tracker()
    t.begin()
    for key in [(1, 0), (1, 1), (0, 0), (0, 2)]:
        t.take(key)
    t.learn_unused({(0, 1)})
    t.end_micro_step(relaunch=True)
    assert t.expected == [2, 1, 1] and t.is_unused((0, 1))
    t.begin()
    for key in [(1, 0), (1, 1), (0, 0)]:
        t.take(key)
    assert [t.pop_ready(), t.pop_ready()] == [0, 1]  # (0, 0) no longer waits for (0, 1)
    assert not t.take((0, 1))  # a late arrival is not counted
    t.readmit(1)
    assert t.expected == [2, 2, 1] and not t.is_unused((0, 1))


def test_window_and_reset() -> None:
    t = _tracker()
    t.begin()
    t.take((1, 0))
    t.end_micro_step(relaunch=False)
    t.begin()
    t.take((0, 0))
    t.end_micro_step(relaunch=False)
    assert t.missing() == [(0, 1), (0, 2), (1, 1)]
    t.zero()
    assert len(t.missing()) == 5
    t.begin()
    t.take((1, 0))
    t.take((1, 1))
    assert t.pop_next() == 0 and t.next_launch == 1
    t.reset()
    assert t.next_launch == 0 and t.arrived == [0, 0, 0] and not t.got
