"""glibc's free-heap figure (``mallinfo2``) that the memory timeline reports beside the tensors."""

from __future__ import annotations

import pytest
import torch

from zerospeed.accelerator.host_malloc import heap_free_bytes


def test_heap_free_bytes_grows_when_heap_tensors_are_freed() -> None:
    if heap_free_bytes() is None:
        pytest.skip("no glibc 2.33+ mallinfo2 here")
    keep = [torch.empty(16_384) for _ in range(200)]  # 64 KiB each: below glibc's mmap threshold, on the heap
    before = heap_free_bytes()  # after the allocations (they may have come from earlier tests' free heap)
    del keep[::2]  # holes between live chunks cannot be trimmed away
    after = heap_free_bytes()
    assert after is not None and after - before >= 50 * 65_536


def test_trimmer_trims_once_enough_heap_was_freed_and_rss_falls(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerospeed.accelerator.host_malloc import HeapTrimmer
    from zerospeed.profiling.memory import rss_bytes

    monkeypatch.setenv("ZEROSPEED_TRIM_HEAP", "full")  # also during backward (the default trims when it starts)
    trimmer = HeapTrimmer.for_device(torch.device("cpu"), 3, min_bytes=32 << 20)
    if trimmer is None:
        pytest.skip("no glibc malloc_trim/mallinfo2 here")
    assert HeapTrimmer.for_device(torch.device("meta"), 3) is None  # only host engines trim
    trimmer.trim()
    parts = [torch.ones(16_384) for _ in range(1600)]  # 100 MiB of 64 KiB heap chunks, touched
    assert not trimmer.trim_if_freed()  # nothing freed yet
    del parts[::2]  # 50 MiB of holes between live chunks: resident until trimmed
    before = rss_bytes()
    assert trimmer.trim_if_freed() and trimmer.trims == 2
    assert before - rss_bytes() >= 30 << 20
    assert not trimmer.trim_if_freed()  # nothing more freed since
    del parts
    trimmer.trim()  # leave no resident free heap behind for the next test's RSS readings


def test_trim_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerospeed.accelerator.host_malloc import HeapTrimmer, heap_trim_setting

    monkeypatch.setenv("ZEROSPEED_TRIM_HEAP", "0")
    assert heap_trim_setting(3) is None and HeapTrimmer.for_device(torch.device("cpu"), 3) is None
    monkeypatch.delenv("ZEROSPEED_TRIM_HEAP")  # auto: the start-of-backward trim at stages 2-3 (measured there)
    assert heap_trim_setting(3) == heap_trim_setting(2) == "start"
    # from FULL_TRIM_PARAMS parameters stage 3 trims during backward too (a 354M GPT's peak needs it); stage 2 not
    assert heap_trim_setting(3, 354_000_000) == "full" and heap_trim_setting(3, 27_000_000) == "start"
    assert heap_trim_setting(2, 354_000_000) == "start" and heap_trim_setting(1, 354_000_000) is None
    assert not any(heap_trim_setting(s) for s in (0, 1))
    # below START_TRIM_PARAMS stage 2 does not trim (its cost there put it above 1.02x DDP); stage 3 still does
    assert heap_trim_setting(2, 7_600_000) is None and heap_trim_setting(2, 27_000_000) == "start"
    assert heap_trim_setting(3, 7_600_000) == "start"
    trimmer = HeapTrimmer.for_device(torch.device("cpu"), 3)
    if trimmer is not None:  # glibc: a start-only trimmer never trims during backward
        assert not trimmer.during and not trimmer.trim_if_freed()
    assert HeapTrimmer.for_device(torch.device("cpu"), 1) is None
    assert HeapTrimmer.for_device(torch.device("meta"), 3) is None
    monkeypatch.setenv("ZEROSPEED_TRIM_HEAP", "1")
    assert all(heap_trim_setting(s) == "full" for s in (0, 1, 2, 3))
    monkeypatch.setenv("ZEROSPEED_TRIM_HEAP", "start")
    assert all(heap_trim_setting(s) == "start" for s in (0, 1, 2, 3))
    assert heap_trim_setting(3, 354_000_000) == "start"  # an explicit mode wins over the size rule
    monkeypatch.setenv("ZEROSPEED_TRIM_HEAP", "yes")
    with pytest.raises(ValueError, match="ZEROSPEED_TRIM_HEAP"):
        heap_trim_setting()
