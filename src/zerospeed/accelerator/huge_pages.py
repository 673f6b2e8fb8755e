"""Large transient host buffers backed by transparent huge pages.

A tensor of more than 32 MiB is always a fresh ``mmap`` in glibc, and so is any tensor above the mmap threshold:
its first touch costs one page fault per 4 KiB page. The engine makes such buffers every step (gradient
buckets, the gradient partition, all-gather outputs), and on CPU the faults were a measured share of ZeRO's
step time (``docs/benchmarks.md``, "Fresh host buffers"). ``madvise(MADV_HUGEPAGE)`` before the first touch
lets the kernel fault the 2 MiB-aligned interior in 2 MiB pages instead (512x fewer faults) where the system's
transparent-huge-page mode is ``madvise`` or ``always``; elsewhere it is a no-op. Only the engine's own buffers
are advised; PyTorch's allocations (activations) are PyTorch's (its ``THP_MEM_ALLOC_ENABLE`` does that for all).

Opt-in (``ZEROSPEED_HUGE_PAGES=1``): on a 27M GPT at world 2 it cut a stage-2 rank's page faults per step from
13-50k to 1-11k, but neither the CPU seconds nor the step time moved beyond noise, and with the kernel's
``defrag=madvise`` a huge-page fault may compact memory synchronously (one 54 MiB fill took 234 ms under load);
so a buffer is advised only while the kernel has twice its size free in 2 MiB blocks (``/proc/buddyinfo``).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

_MADV_HUGEPAGE = 14
_HUGE = 2 << 20
MIN_BYTES = 2 * _HUGE  # below this the aligned interior is at most one huge page


@lru_cache(maxsize=1)
def _madvise() -> object | None:
    if os.environ.get("ZEROSPEED_HUGE_PAGES", "0") != "1":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):  # not Linux/glibc: nothing to advise
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def free_huge_page_bytes(path: str = "/proc/buddyinfo") -> int:
    """Bytes the kernel holds free in blocks of 2 MiB or more (orders >= 9 of ``/proc/buddyinfo``, 4 KiB
    pages): what huge-page faults can take without compacting memory; 0 when unknown."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    total = 0
    for line in lines:
        counts = line.split()[4:]  # "Node 0, zone Normal c0 c1 ... c10"
        total += sum(int(c) << (order + 12) for order, c in enumerate(counts) if order >= 9 and c.isdigit())
    return total


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under ``t``'s storage (call before first touch); True when the advice was taken."""
    nbytes = t.untyped_storage().nbytes()
    if t.device.type != "cpu" or nbytes < MIN_BYTES:
        return False
    fn = _madvise()
    if fn is None or free_huge_page_bytes() < 2 * nbytes:  # no compaction stall: only from free 2 MiB blocks
        return False
    start = t.untyped_storage().data_ptr()
    lo = -(-start // _HUGE) * _HUGE
    hi = (start + nbytes) // _HUGE * _HUGE
    return hi > lo and fn(lo, hi - lo, _MADV_HUGEPAGE) == 0  # type: ignore[operator]


def empty_buffer(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.empty(numel)``; on the host, advised to huge pages when large."""
    t = torch.empty(numel, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t


def zeros_buffer(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(numel)``; on the host, advised to huge pages before the zeros are written."""
    return empty_buffer(numel, dtype, device).zero_()
