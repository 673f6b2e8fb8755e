"""Measured memory (not accounting): the peak of a block on CPU is the process RSS peak, transients included."""

from __future__ import annotations

import torch

from zerospeed.profiling.memory import PeakMeter, measure_memory
from zerospeed.profiling.memory_timeline import malloc_trim

MB = 1024 * 1024


def _transient(mib: int) -> None:
    t = torch.ones(mib * MB // 4)  # written, so its pages are resident
    del t


def _no_spare_heap() -> None:
    """Give free heap pages back first: an earlier test in this worker (the engine pins glibc's mmap threshold)
    can leave resident free heap that would serve the transient without any growth of the RSS."""
    malloc_trim()


def test_measure_memory_sees_a_transient_tensor() -> None:
    _no_spare_heap()
    with measure_memory() as quiet:
        torch.zeros(16)
    with measure_memory() as busy:
        _transient(128)
    assert busy.source.startswith("process RSS") and busy.start_bytes > 0
    assert busy.peak_bytes >= busy.start_bytes
    assert busy.growth_bytes >= 100 * MB, busy  # freed before the block ended, still measured
    assert quiet.growth_bytes < busy.growth_bytes - 64 * MB, (quiet, busy)
    assert busy.as_dict()["growth_bytes"] == busy.growth_bytes


def test_peak_meter_spans_calls_and_keeps_the_last() -> None:
    _no_spare_heap()
    meter = PeakMeter()
    assert meter.stop() is None and meter.last is None
    meter.start()
    _transient(96)
    meter.start()  # already running: does not reset the peak
    done = meter.stop()
    assert done is meter.last and done is not None and done.growth_bytes >= 72 * MB
    assert meter.current is None
