"""Host heap: large tensors go back to the OS when freed, so a rank's RSS follows its live tensors.

glibc serves a request of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with its own ``mmap``, which
``free`` unmaps at once. But the threshold is *dynamic*: each time such a block is freed, glibc raises the
threshold to its size (up to 32 MiB), so from then on tensors of that size come from the heap, where freed
memory stays resident and is fragmented by the next, differently sized requests. A training step frees and
allocates activation-sized tensors all the time; with the dynamic threshold the peak RSS of a rank ends up
well above its peak of live tensor bytes (``zerospeed report memory`` shows it as ``other``).

Setting the threshold explicitly turns the dynamic rule off: every tensor of at least ``threshold`` bytes is
mapped and unmapped on its own. The cost is a page fault per first touch of a fresh page: measured on a quiet
machine (27M-parameter GPT, world 2, CPU) it made every stage's step about 20 % slower (stage 0: 1.20x DDP's
step time against 0.99x without it) while cutting peak RSS by 10-30 %. So it is opt-in:
``ZEROSPEED_MMAP_THRESHOLD=<bytes>`` (``RECOMMENDED_MMAP_THRESHOLD``, 1 MiB, is what the memory figures used;
``0`` or unset: glibc's default). A ``MALLOC_MMAP_THRESHOLD_`` set by the user is glibc's own setting and is
left alone.
"""

from __future__ import annotations

import ctypes
import os

RECOMMENDED_MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def mmap_threshold_setting() -> int:
    """The threshold to set (0: none) from ``ZEROSPEED_MMAP_THRESHOLD`` (unset: none)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return 0
    raw = os.environ.get("ZEROSPEED_MMAP_THRESHOLD", "0")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"ZEROSPEED_MMAP_THRESHOLD must be a number of bytes (0 to leave glibc's default), "
                         f"got {raw!r}") from None
    if value < 0:
        raise ValueError(f"ZEROSPEED_MMAP_THRESHOLD must be >= 0, got {value}")
    return value


def limit_heap_retention(threshold: int | None = None) -> bool:
    """Fix glibc's mmap threshold (``threshold`` bytes; default from the environment); False when not applied."""
    value = mmap_threshold_setting() if threshold is None else threshold
    if value <= 0:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to tune
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(value)))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_free_bytes() -> int | None:
    """Bytes glibc's heap holds free (``mallinfo2().fordblks`` over all arenas): memory the process keeps
    after ``free`` and that counts in its RSS once touched; None without glibc 2.33+."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return int(fn().fordblks)
