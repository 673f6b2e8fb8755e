"""Timers: accumulate over start/stop, synchronize the device, format a DeepSpeed-style log line."""

from __future__ import annotations

import re

import pytest

from zerospeed.profiling.timers import Timer, Timers


def test_start_stop_accumulates_and_resets() -> None:
    syncs: list[int] = []
    timers = Timers(synchronize=lambda: syncs.append(1))
    fwd = timers("forward")
    assert timers("forward") is fwd and timers.has("forward") and not timers.has("backward")
    for _ in range(3):
        fwd.start()
        assert fwd.running
        fwd.stop()
    assert fwd.count == 3 and not fwd.running
    assert len(syncs) == 6  # every start and stop waits for the device
    total = fwd.elapsed(reset=False)
    assert total >= 0.0 and fwd.count == 3
    assert fwd.mean(reset=False) == pytest.approx(total / 3)
    assert fwd.elapsed() == pytest.approx(total)  # reset=True by default (DeepSpeed)
    assert fwd.count == 0 and fwd.elapsed() == 0.0


def test_running_timer_can_be_read_and_keeps_running() -> None:
    timer = Timer("step", synchronize=lambda: None)
    timer.start()
    assert timer.elapsed(reset=True) >= 0.0
    assert timer.running
    timer.stop()
    assert timer.count == 1


def test_misuse_is_reported() -> None:
    timer = Timer("x", synchronize=lambda: None)
    with pytest.raises(RuntimeError, match="not started"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="already started"):
        timer.start()
    with pytest.raises(ValueError, match="normalizer"):
        Timers().log(["x"], normalizer=0)


def test_log_formats_named_timers_in_ms() -> None:
    timers = Timers(synchronize=lambda: None)
    for name in ("forward", "backward", "step"):
        timers(name).start()
        timers(name).stop()
    line = timers.log(["forward", "backward", "missing", "step"], normalizer=2.0)
    assert re.fullmatch(r"time \(ms\) \| forward: \d+\.\d\d \| backward: \d+\.\d\d \| step: \d+\.\d\d", line), line
    assert timers("forward").count == 0  # log resets by default
    assert timers.names() == ["forward", "backward", "step"]  # logging an unknown name creates nothing
