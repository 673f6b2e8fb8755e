"""Memory reports: DeepSpeed's ``see_memory_usage``, a resettable per-rank peak tracker, and step measurements.

Two kinds of figures, never to be confused: ``engine.memory_breakdown()`` is *accounting* (the bytes of
persistent model state the library holds: params, grads, masters, optimizer state), while
:func:`measure_memory` is a *measurement* of what the process really used over a block (allocator peak on
CUDA, resident-set peak on the host), transient buffers included (activations, gathered parameters,
communication buckets, temporaries).

On CUDA the numbers come from the caching allocator (allocated / reserved / their peaks). On the host they
come from the process resident set: current RSS via psutil, and the peak ("high-water mark", VmHWM) from
``/proc/self/status``. Linux lets a process reset its own high-water mark by writing ``5`` to
``/proc/self/clear_refs``, which gives a true resettable host peak; where that is unavailable we fall back to
``max(getrusage max RSS since start, RSS samples taken by the tracker)``.
"""

from __future__ import annotations

import os
import re
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch

from ._device import cuda_active

GB = 1024**3


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return int(psutil.Process().memory_info().rss)


def _hwm_from_proc() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            match = re.search(r"^VmHWM:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter for this process; False when not supported."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """Peak RSS of this process since start or since the last successful reset."""
    hwm = _hwm_from_proc()
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # macOS reports bytes, Linux kB


class ProcMemory:
    """Cheap per-operator reads of this process's RSS and its resettable high-water mark (Linux ``/proc``).

    ``rss_and_peak()`` reads both from one ``/proc/self/status`` (about 10 us through a kept descriptor);
    ``reset_peak()`` writes ``5`` to ``/proc/self/clear_refs``. Open it in the process that reads (a forked
    child must not reuse its parent's descriptors) and ``close()`` it. ``available`` is False where ``/proc``
    lacks either file; then nothing is read.
    """

    def __init__(self) -> None:
        self._status = self._clear = -1
        try:
            self._status = os.open("/proc/self/status", os.O_RDONLY)
            self._clear = os.open("/proc/self/clear_refs", os.O_WRONLY)
            self.available = self.rss_and_peak() is not None
        except OSError:
            self.available = False
        if not self.available:
            self.close()

    def rss_and_peak(self) -> tuple[int, int] | None:
        """(current RSS, high-water mark since the last reset) in bytes."""
        try:
            text = os.pread(self._status, 8192, 0)
            i, j = text.index(b"VmRSS:"), text.index(b"VmHWM:")
            return (int(text[i + 6:text.index(b"kB", i)]) * 1024, int(text[j + 6:text.index(b"kB", j)]) * 1024)
        except (OSError, ValueError):
            return None

    def reset_peak(self) -> None:
        try:
            os.write(self._clear, b"5")
        except OSError:
            pass

    def close(self) -> None:
        for fd in (self._status, self._clear):
            if fd >= 0:
                os.close(fd)
        self._status = self._clear = -1
        self.available = False


class MemoryTracker:
    """Peak memory of this rank between :meth:`reset_peak` and :meth:`peak_bytes`.

    ``device`` selects the counter: a CUDA device uses the allocator's peak allocated bytes; anything else
    (the default on CPU) uses the process peak RSS. Benchmarks call ``reset_peak()`` before a step and
    ``peak_bytes()`` after it, once per rank.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if cuda_active() else torch.device("cpu")
        self.device = torch.device(device)
        self._sampled_peak = 0
        self._resettable = True
        self.reset_peak()

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def current_bytes(self) -> int:
        if self.on_cuda:
            return int(torch.cuda.memory_allocated(self.device))
        return rss_bytes()

    def sample(self) -> int:
        """Record the current usage into the peak (useful where the kernel peak cannot be reset)."""
        now = self.current_bytes()
        self._sampled_peak = max(self._sampled_peak, now)
        return now

    def reset_peak(self) -> None:
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._resettable = _reset_hwm()
        self._sampled_peak = 0
        self.sample()

    def peak_bytes(self) -> int:
        """Peak bytes since the last reset (never below the current usage)."""
        now = self.sample()
        if self.on_cuda:
            return max(int(torch.cuda.max_memory_allocated(self.device)), now)
        kernel_peak = peak_rss_bytes() if self._resettable else 0
        return max(kernel_peak, self._sampled_peak, now)

    def report(self) -> dict[str, int]:
        return {"current_bytes": self.current_bytes(), "peak_bytes": self.peak_bytes()}


@dataclass
class MemoryMeasurement:
    """Measured memory of one block: where the numbers come from, usage at its start, and its peak."""

    source: str  # "cuda allocator (max_memory_allocated)" or "process RSS (peak resident set)"
    start_bytes: int
    peak_bytes: int = 0

    @property
    def growth_bytes(self) -> int:
        """Peak above the start: what the block needed on top of what was already resident."""
        return max(0, self.peak_bytes - self.start_bytes)

    def as_dict(self) -> dict[str, int | str]:
        return {"source": self.source, "start_bytes": self.start_bytes, "peak_bytes": self.peak_bytes,
                "growth_bytes": self.growth_bytes}


class PeakMeter:
    """Start/stop form of :func:`measure_memory`, for a block that spans hooks (the engine's step).

    ``start()`` while running is a no-op, so the first micro-step of an accumulation opens the measurement
    and the optimizer step closes it; ``last`` keeps the latest finished measurement.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.last: MemoryMeasurement | None = None
        self._tracker: MemoryTracker | None = None
        self._current: MemoryMeasurement | None = None

    @property
    def current(self) -> MemoryMeasurement | None:
        """The measurement in progress (its ``peak_bytes`` is set by :meth:`stop`)."""
        return self._current

    def start(self) -> None:
        if self._current is not None:
            return
        self._tracker = MemoryTracker(self.device)  # resets the peak counter
        source = "cuda allocator (max_memory_allocated)" if self._tracker.on_cuda else "process RSS (peak resident set)"
        self._current = MemoryMeasurement(source, self._tracker.current_bytes())

    def stop(self) -> MemoryMeasurement | None:
        if self._current is None or self._tracker is None:
            return None
        self._current.peak_bytes = self._tracker.peak_bytes()
        self.last, self._current, self._tracker = self._current, None, None
        return self.last


@contextmanager
def measure_memory(device: torch.device | str | None = None) -> Iterator[MemoryMeasurement]:
    """Measure the peak memory of the ``with`` block (transient buffers included).

    CUDA: the caching allocator's peak allocated bytes (its peak counter is reset at the start). Host: the
    kernel's peak RSS of this process (reset at the start through ``/proc/self/clear_refs``). Both resets
    are process-wide: a peak read elsewhere afterwards covers only the time since this block began.
    ``peak_bytes`` is filled in when the block ends.
    """
    meter = PeakMeter(device)
    meter.start()
    assert meter.current is not None
    try:
        yield meter.current
    finally:
        meter.stop()


def memory_usage_string(message: str) -> str:
    """One line: device allocated/reserved and their peaks (CUDA), host virtual memory, RSS and peak RSS."""
    parts = [message]
    if cuda_active():
        parts += [
            f"MA {torch.cuda.memory_allocated() / GB:.2f} GB",
            f"Max_MA {torch.cuda.max_memory_allocated() / GB:.2f} GB",
            f"CA {torch.cuda.memory_reserved() / GB:.2f} GB",
            f"Max_CA {torch.cuda.max_memory_reserved() / GB:.2f} GB",
        ]
    vm = psutil.virtual_memory()
    parts += [
        f"CPU Virtual Memory: used = {(vm.total - vm.available) / GB:.2f} GB, percent = {vm.percent}%",
        f"RSS {rss_bytes() / GB:.2f} GB",
        f"peak RSS {peak_rss_bytes() / GB:.2f} GB",
    ]
    return " | ".join(parts)


def see_memory_usage(message: str, force: bool = False) -> str | None:
    """Print (on rank 0 only) and return the memory line; does nothing unless ``force`` (as DeepSpeed).

    Like DeepSpeed, the CUDA peak counters are reset after reading so consecutive calls show per-interval
    peaks. The rank comes from the ``RANK`` environment variable the launcher sets.
    """
    if not force:
        return None
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    line = memory_usage_string(message)
    print(line, flush=True)
    if cuda_active():
        torch.cuda.reset_peak_memory_stats()
    return line
