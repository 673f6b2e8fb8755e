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


def _mallinfo2() -> object | None:
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()  # the function (immutable); None without glibc 2.33+


def heap_free_bytes() -> int | None:
    """Bytes glibc's heap holds free (``mallinfo2().fordblks`` over all arenas): memory the process keeps
    after ``free`` and that counts in its RSS once touched; None without glibc 2.33+."""
    return None if _MALLINFO2 is None else int(_MALLINFO2().fordblks)  # type: ignore[operator]


TRIM_MIN_BYTES = 128 << 20  # in backward: trim once this much more heap is free than after the last trim


TRIM_STAGES = frozenset({2, 3})  # ``auto``: the stages chosen for their memory (measured: docs/benchmarks.md)
# ``auto``: stage 2 trims from this size only (7.6M GPT: +2.7 % CPU for -76 MiB, which put stage 2 above 1.02x DDP;
# 27.4M: +1.2 % for -94 MiB); stage 3's start trim is cheap at every size measured (7.6M: +0.4 % for -91 MiB)
START_TRIM_PARAMS = {2: 20_000_000, 3: 0}
FULL_TRIM_STAGES, FULL_TRIM_PARAMS = frozenset({3}), 100_000_000  # ``auto``: the full trim there from this size


def heap_trim_setting(zero_stage: int | None = None, num_params: int | None = None) -> str | None:
    """``ZEROSPEED_TRIM_HEAP``: how a host engine at ``zero_stage`` (training a model of ``num_params``) gives
    freed heap back, or None (never).

    * ``auto`` (default): at ZeRO stage 3 with at least ``FULL_TRIM_PARAMS`` parameters ``"full"``, else
      ``"start"`` at stage 3 and at stage 2 from ``START_TRIM_PARAMS`` parameters (unknown size: trim). The trim when backward starts takes the forward's freed temporaries out of
      the peak for about a quarter of the full trim's CPU cost (27M GPT, world 2, stage 3, paired: peak RSS
      -100 to -130 MiB per rank for +2.3-2.5 % CPU; the full trim -142 to -196 MiB for +5-10 %). On a 354M GPT
      the start-only trim left stage 3's peak above FSDP2's (6320 against 5183 MiB per rank) and the full trim
      put it below (5006 against 5208) at 1.00x DDP's CPU time (FSDP2 1.36x), so large models trim fully
      (docs/benchmarks.md, issue 38's sweep);
    * ``start``: that trim at every stage; ``1`` / ``full``: also during backward (the freed activations,
      checked at each bucket launch), at every stage; ``0``: never."""
    raw = os.environ.get("ZEROSPEED_TRIM_HEAP", "auto")
    if raw not in ("0", "1", "auto", "start", "full"):
        raise ValueError(f"ZEROSPEED_TRIM_HEAP must be 0, 1, auto, start or full, got {raw!r}")
    if raw == "auto":
        if zero_stage in FULL_TRIM_STAGES and num_params is not None and num_params >= FULL_TRIM_PARAMS:
            return "full"
        if zero_stage not in TRIM_STAGES:
            return None
        small = num_params is not None and num_params < START_TRIM_PARAMS.get(zero_stage, 0)
        return None if small else "start"
    return {"0": None, "1": "full"}.get(raw, raw)


class HeapTrimmer:
    """Give the free pages of glibc's heap back to the OS (``malloc_trim``) at two points of a host backward.

    The idea: at glibc's default (dynamic) mmap threshold, activations and temporaries below 32 MiB live on
    the heap; when they are freed their pages stay resident, and the big tensors made next (the loss's
    gradients at the start of backward; the last, embedding-sized gradients and buckets at its end) are
    fresh mappings *on top of* them, so a rank's peak RSS is live tensors plus the heap freed before. Trimming
    (1) when backward starts (the forward's freed temporaries) and (2) during backward whenever the free heap
    grew by ``min_bytes`` since the last trim (the freed activations; checked at each gradient-bucket launch)
    takes that memory out of the peak: GPT-2-small stage 3 at world 2, -543 MiB (-12.7 %) of peak RSS per rank
    (docs/benchmarks.md). Cost: the released pages are faulted in again when reused (mostly by the next
    forward's activations): +5 % CPU time per step on GPT-2-small, +2 % on a 2-layer model of its width
    (``benchmarks/bench_heap_trim.py``), +5-10 % on a 27M GPT; the fixed mmap threshold
    (``ZEROSPEED_MMAP_THRESHOLD``, ~20 %) pays a fault per fresh page of every large tensor instead. Trim (1)
    alone (``during=False``: ``ZEROSPEED_TRIM_HEAP=start``, the stage 2-3 default) keeps most of the saving for
    a quarter of the cost (``heap_trim_setting``). Only for engines whose tensors are on the host and only with
    glibc (``for_device`` returns None otherwise).
    """

    def __init__(self, trim: object, min_bytes: int = TRIM_MIN_BYTES, during: bool = True) -> None:
        self._trim = trim
        self.min_bytes = min_bytes
        self.during = during  # also trim during backward (``trim_if_freed``), not only when it starts
        self._low: int | None = None  # free heap right after the last trim (or the lowest seen since)
        self.trims = 0

    @classmethod
    def for_device(cls, device: object, zero_stage: int | None = None, min_bytes: int = TRIM_MIN_BYTES,
                   num_params: int | None = None) -> HeapTrimmer | None:
        """A trimmer for an engine on ``device`` at ``zero_stage`` training ``num_params`` parameters (see
        ``heap_trim_setting``), or None."""
        mode = heap_trim_setting(zero_stage, num_params)
        if getattr(device, "type", str(device)) != "cpu" or mode is None or heap_free_bytes() is None:
            return None
        try:
            fn = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            return None
        fn.argtypes = [ctypes.c_size_t]
        return cls(fn, min_bytes, during=mode == "full")

    def trim(self) -> None:
        """Trim now (the start of backward)."""
        self._trim(0)  # type: ignore[operator]
        self._low = heap_free_bytes()
        self.trims += 1

    def trim_if_freed(self) -> bool:
        """Trim when at least ``min_bytes`` more heap is free than after the last trim (and ``during``); True when
        it trimmed."""
        if not self.during:
            return False
        free = heap_free_bytes()
        if free is None:
            return False
        if self._low is None or free < self._low:
            self._low = free  # reused since: count what is freed from here
            return False
        if free - self._low < self.min_bytes:
            return False
        self.trim()
        return True
