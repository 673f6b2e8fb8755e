"""glibc's free-heap figure (``mallinfo2``) that the memory timeline reports beside the tensors."""

from __future__ import annotations

import pytest
import torch

from zerospeed.accelerator.host_malloc import heap_free_bytes


def test_heap_free_bytes_grows_when_heap_tensors_are_freed() -> None:
    before = heap_free_bytes()
    if before is None:
        pytest.skip("no glibc 2.33+ mallinfo2 here")
    keep = [torch.empty(16_384) for _ in range(200)]  # 64 KiB each: below glibc's mmap threshold, on the heap
    del keep[::2]  # holes between live chunks cannot be trimmed away
    after = heap_free_bytes()
    assert after is not None and after - before >= 50 * 65_536
