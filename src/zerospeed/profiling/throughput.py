"""DeepSpeed's ``engine.tput_timer``: samples per second averaged over the optimizer steps so far.

The engine's observer measures each step (the wall time between accumulation boundaries) and hands it
here; as in DeepSpeed the first ``start_step`` steps (warm-up) are left out of the average. The
``timers.throughput`` section: ``enabled: false`` records nothing (the average stays ``-inf``), and
``synchronized`` waits for the device before the clock is read (``read_clock``), so a step's time includes
its queued kernels.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ._device import synchronize as _device_sync


class ThroughputTimer:
    """Running average throughput of a training engine (DeepSpeed's names and meaning)."""

    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output: int | None = None,
                 enabled: bool = True, synchronized: bool = True,
                 synchronize: Callable[[], None] = _device_sync) -> None:
        self.enabled, self.synchronized, self._sync = enabled, synchronized, synchronize
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.started = False
        self._start_time = 0.0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def read_clock(self) -> float:
        """``time.perf_counter()``, after the device's queued work when enabled and synchronized."""
        if self.enabled and self.synchronized:
            self._sync()
        return time.perf_counter()

    def start(self) -> None:
        """Begin timing a micro-step by hand (the engine times its own steps without it)."""
        if not self.enabled:
            return
        self.started = True
        self._start_time = self.read_clock()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End a micro-step timed with :meth:`start`; ``global_step`` ends an optimizer step."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.record_step(self.read_clock() - self._start_time, micro_steps=0)

    def record_step(self, seconds: float, micro_steps: int = 1) -> None:
        """One optimizer step took ``seconds``; steps after the warm-up count toward the average."""
        if not self.enabled:
            return
        self.micro_step_count += micro_steps
        self.global_step_count += 1
        self.step_elapsed_time = seconds
        if self.global_step_count > self.start_step:
            self.total_elapsed_time += seconds

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the steps after the warm-up (``-inf`` before the first step, as DeepSpeed)."""
        counted = self.global_step_count - self.start_step
        if self.global_step_count == 0:
            return float("-inf")
        if counted <= 0 or self.total_elapsed_time <= 0:
            return self.batch_size / max(self.step_elapsed_time, 1e-9)
        return self.batch_size / (self.total_elapsed_time / counted)
