"""Named wall-clock timers that synchronize the device, like DeepSpeed's ``SynchronizedWallClockTimer``.

``timers("forward").start()`` ... ``timers("forward").stop()`` accumulates seconds across start/stop pairs;
``timers.log(["forward", "backward"])`` formats ``time (ms) | forward: 12.34 | backward: 20.10`` and resets.
Synchronizing before reading the clock makes a timer measure the device work, not only its launch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

from ._device import synchronize as _default_sync


class Timer:
    """One named timer: accumulates elapsed seconds over start/stop pairs."""

    def __init__(self, name: str, synchronize: Callable[[], None] = _default_sync) -> None:
        self.name = name
        self._sync = synchronize
        self._elapsed = 0.0
        self._started_at: float | None = None
        self.count = 0  # completed start/stop pairs since the last reset

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def start(self) -> None:
        if self._started_at is not None:
            raise RuntimeError(f"timer '{self.name}' is already started")
        self._sync()
        self._started_at = time.perf_counter()

    def stop(self) -> None:
        if self._started_at is None:
            raise RuntimeError(f"timer '{self.name}' is not started")
        self._sync()
        self._elapsed += time.perf_counter() - self._started_at
        self._started_at = None
        self.count += 1

    def reset(self) -> None:
        self._elapsed = 0.0
        self._started_at = None
        self.count = 0

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated milliseconds (as DeepSpeed); a running timer is read without being stopped."""
        total = self._elapsed
        if self._started_at is not None:
            self._sync()
            total += time.perf_counter() - self._started_at
        if reset:
            running = self._started_at is not None
            self.reset()
            if running:
                self._started_at = time.perf_counter()
        return total * 1000.0

    def mean(self, reset: bool = True) -> float:
        """Mean milliseconds per completed start/stop pair (0 when none)."""
        count = self.count
        total = self.elapsed(reset=reset)
        return total / count if count else 0.0


class Timers:
    """A registry of named :class:`Timer` objects; ``timers(name)`` creates on first use."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self._sync = synchronize or _default_sync
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = Timer(name, self._sync)
        return timer

    def has(self, name: str) -> bool:
        return name in self._timers

    def names(self) -> list[str]:
        return list(self._timers)

    def reset(self) -> None:
        for timer in self._timers.values():
            timer.reset()

    def elapsed(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """Milliseconds per name divided by ``normalizer``; unknown names are skipped."""
        if normalizer <= 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        return {n: self._timers[n].elapsed(reset=reset) / normalizer for n in names if n in self._timers}

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> str:
        """Format ``time (ms) | name: 1.23 | ...`` for the given timers (the caller prints it on rank 0)."""
        parts = [f"{name}: {ms:.2f}" for name, ms in self.elapsed(names, normalizer, reset).items()]
        return " | ".join(["time (ms)", *parts])


def trim_mean(data: list[float], trim_percent: float) -> float:
    """The mean of ``data`` without its ``round(len * trim_percent)`` smallest and largest values (DeepSpeed's
    ``deepspeed.utils.timer.trim_mean``); 0 for an empty list; ``data`` itself is left in its order."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must be in [0, 1], got {trim_percent}")
    if not data:
        return 0
    k = int(round(len(data) * trim_percent))
    return statistics.mean(sorted(data)[k:len(data) - k])
