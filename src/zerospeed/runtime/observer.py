"""What the engine reports each step: wall-clock breakdown, monitors, the flops profile, throughput.

The engine calls four hooks (forward start/end, backward start/end, step end); everything that
depends on the ``wall_clock_breakdown``, ``tensorboard`` / ``csv_monitor`` / ``wandb`` / ``comet``, ``timers``,
``flops_profiler`` and ``comms_logger`` sections lives here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from .. import comm
from ..config import ZeroSpeedConfig
from ..profiling.flops_profiler import FlopsProfiler
from ..profiling.memory import PeakMeter, peak_rss_bytes
from ..profiling.monitor import build_monitors
from ..profiling.throughput import ThroughputTimer
from ..profiling.timers import Timers

if TYPE_CHECKING:
    from .engine import Engine

FORWARD, BACKWARD, STEP = "forward", "backward", "step"


class StepObserver:
    def __init__(self, engine: Engine, config: ZeroSpeedConfig, rank: int) -> None:
        self.engine = engine
        self.config = config
        self.rank = rank
        self.timers = Timers()
        self.breakdown = config.wall_clock_breakdown
        self.monitor = build_monitors(config.tensorboard, config.csv_monitor, config.wandb, rank=rank,
                                      comet=config.comet)
        self.flops_profiler = (FlopsProfiler(engine.module, engine, config=config.flops_profiler)
                               if config.flops_profiler.enabled and rank == 0 else None)
        self.loss_sum: torch.Tensor | float = 0.0
        self.step_started = time.perf_counter()
        self.last_step_seconds = 0.0
        self.history: list[dict[str, float]] = []
        self._comm_seconds = 0.0
        # memory_breakdown: measure each step's real peak (transient buffers included) beside the accounting
        self.memory_meter = PeakMeter(engine.device) if config.memory_breakdown else None
        throughput = config.timers.throughput
        self.tput_timer = ThroughputTimer(engine.train_batch_size(), steps_per_output=config.steps_per_print,
                                          enabled=throughput.enabled, synchronized=throughput.synchronized)

    # --- hooks ------------------------------------------------------------------------------------
    def forward_start(self) -> None:
        if self.memory_meter is not None:
            self.memory_meter.start()  # no-op after the first micro-step of the step
        if self.flops_profiler is not None:
            self.flops_profiler.on_forward_start(self.engine.global_steps + 1)
        if self.breakdown:
            self.timers(FORWARD).start()

    def forward_end(self) -> None:
        if self.breakdown:
            self.timers(FORWARD).stop()
        if self.flops_profiler is not None:
            self.flops_profiler.on_forward_end()

    def backward_start(self, loss: torch.Tensor | None) -> None:
        # Kept on the device: read back once per optimizer step, not once per micro-step (None: loss.backward()
        # on the outputs, where the engine does not see the loss).
        if loss is not None:
            self.loss_sum = self.loss_sum + loss.detach().float() / self.engine.gradient_accumulation_steps()
        if self.breakdown:
            self.timers(BACKWARD).start()

    def backward_end(self) -> None:
        if self.breakdown:
            self.timers(BACKWARD).stop()

    def step_start(self) -> None:
        if self.breakdown:
            self.timers(STEP).start()

    def step_end(self, boundary: bool) -> None:
        if self.breakdown:
            self.timers(STEP).stop()
        if not boundary:
            return
        if self.memory_meter is not None:
            self.memory_meter.stop()
        eng = self.engine
        now = self.tput_timer.read_clock()
        self.last_step_seconds = now - self.step_started
        self.step_started = now
        self.tput_timer.record_step(self.last_step_seconds, eng.gradient_accumulation_steps())
        if self.flops_profiler is not None:
            self.flops_profiler.on_step_end(eng.global_steps)
        comm_total = sum(st.seconds for st in eng.comms.stats.values())
        record = {"step": float(eng.global_steps), "loss": float(self.loss_sum),
                  "samples_per_sec": eng.train_batch_size() / max(self.last_step_seconds, 1e-9),
                  "step_seconds": self.last_step_seconds, "comm_seconds": comm_total - self._comm_seconds}
        self._comm_seconds = comm_total
        self.loss_sum = 0.0
        self.history.append(record)
        self._write_monitors(record)
        every = self.config.steps_per_print  # None (DeepSpeed's default): no progress line
        if self.rank == 0 and every is not None and eng.global_steps % every == 0:
            self._print(record, every)
        elif self.rank == 0 and every is None and self.breakdown:
            self._print_breakdown(record, 1)  # as DeepSpeed: the timers are logged on every step

    # --- outputs ----------------------------------------------------------------------------------
    def _print_breakdown(self, record: dict[str, float], steps: int) -> None:
        names = [n for n in (FORWARD, BACKWARD, STEP) if self.timers.has(n)]
        print("[zerospeed] " + self.timers.log(names, normalizer=float(steps))
              + f" | comm (last step): {record['comm_seconds'] * 1e3:.2f}", flush=True)

    def _write_monitors(self, record: dict[str, float]) -> None:
        if not self.monitor.enabled:
            return
        eng = self.engine
        x = eng.global_samples
        events: list[tuple[str, float, int]] = [
            ("Train/Samples/train_loss", record["loss"], x),
            ("Train/Samples/lr", eng.get_lr()[0] if eng.get_lr() else 0.0, x),
            ("Train/Samples/samples_per_sec", record["samples_per_sec"], x),
            ("Train/Samples/model_state_bytes", float(eng.memory_breakdown()["model_states"]), x),
            ("Train/Samples/peak_rss_bytes", float(peak_rss_bytes()), x),
        ]
        if eng.optimizer is not None and eng.optimizer.loss_scaler.dynamic:
            events.append(("Train/Samples/loss_scale", eng.loss_scale, x))
        norm = eng.get_global_grad_norm()
        if norm is not None:
            events.append(("Train/Samples/grad_norm", norm, x))
        if self.breakdown:
            for name, ms in self.timers.elapsed([FORWARD, BACKWARD, STEP], reset=False).items():
                events.append((f"Train/Samples/elapsed_time_ms_{name}", ms, x))
        self.monitor.write_events(events)

    def _print(self, record: dict[str, float], every: int) -> None:
        eng = self.engine
        parts = [f"step={eng.global_steps}", f"skipped={eng.skipped_steps}", f"loss={record['loss']:.4f}",
                 f"lr={eng.get_lr()}", f"samples/s={record['samples_per_sec']:.1f}"]
        if eng.optimizer is not None and eng.optimizer.loss_scaler.dynamic:
            parts.append(f"loss_scale={eng.loss_scale:g}")
        print("[zerospeed] " + ", ".join(parts), flush=True)
        if self.breakdown:
            self._print_breakdown(record, every)
        if self.config.memory_breakdown:
            print(f"[zerospeed] rank {self.rank} model-state bytes (accounted): {eng.memory_breakdown()}", flush=True)
            measured = eng.measured_memory()
            if measured is not None:
                print(f"[zerospeed] rank {self.rank} step peak (measured: {measured['source']}): "
                      f"{measured['peak_bytes'] / 2**20:.1f} MiB, +{measured['growth_bytes'] / 2**20:.1f} MiB "
                      "over the step's start", flush=True)
        if self.config.comms_logger.enabled:
            print(eng.comms.summary(eng.dp_world_size), flush=True)

    def close(self) -> None:
        self.monitor.flush()
        self.monitor.close()

    def wall_clock_breakdown(self) -> bool:
        return self.breakdown

    def summary(self) -> dict[str, Any]:
        return {"steps": len(self.history), "last": self.history[-1] if self.history else None}
