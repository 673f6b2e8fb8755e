"""Memory reports: see_memory_usage line and a resettable per-rank peak tracker (host RSS on CPU)."""

from __future__ import annotations

import mmap

import pytest

from zerospeed.profiling.memory import MemoryTracker, peak_rss_bytes, rss_bytes, see_memory_usage

MB = 1024 * 1024


def test_see_memory_usage_only_when_forced_and_on_rank0(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    assert see_memory_usage("quiet") is None
    monkeypatch.setenv("RANK", "0")
    line = see_memory_usage("after init", force=True)
    assert line is not None and line.startswith("after init | ")
    assert "RSS" in line and "peak RSS" in line and "CPU Virtual Memory" in line
    assert line in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")
    assert see_memory_usage("other rank", force=True) is None


def test_host_rss_and_peak() -> None:
    assert rss_bytes() > 0
    assert peak_rss_bytes() >= rss_bytes() - 8 * MB  # peak is a high-water mark of rss


def test_tracker_sees_a_transient_host_allocation_and_resets() -> None:
    tracker = MemoryTracker()
    assert tracker.device.type == "cpu"
    tracker.reset_peak()
    before = tracker.current_bytes()
    # An anonymous mapping, written so its pages are resident, then unmapped: the pages go back to the OS
    # for certain (a freed tensor may stay in the C allocator's heap, depending on what ran before).
    big = mmap.mmap(-1, 64 * MB)
    big.write(b"\1" * (64 * MB))
    peak_with = tracker.peak_bytes()
    big.close()
    assert peak_with >= before + 48 * MB
    tracker.reset_peak()
    assert tracker.peak_bytes() < peak_with - 32 * MB
    report = tracker.report()
    assert report["peak_bytes"] >= report["current_bytes"] > 0
