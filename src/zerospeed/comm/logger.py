"""Comms accounting: every collective we issue is counted (bytes, volume, latency) per op kind.

``bytes`` is the message size (the tensor a rank hands to the collective). ``volume`` is the data a
rank moves under the bandwidth-optimal ring algorithm, in the ZeRO paper's convention:
all-reduce = 2 x message, reduce-scatter = the full input, all-gather = the full output,
broadcast = message. So plain data parallelism moves 2 Psi per step, ZeRO-1/2 2 Psi, ZeRO-3 3 Psi.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

_COMM_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class OpStats:
    count: int = 0
    bytes: int = 0
    volume: int = 0
    seconds: float = 0.0
    sizes: dict[int, int] = field(default_factory=dict)
    callers: dict[str, int] = field(default_factory=dict)  # with ``debug``: calls per calling function
    groups: dict[tuple[int, ...], int] = field(default_factory=dict)  # message bytes per group (its global ranks)


def caller_function() -> str:
    """Name of the function that issued the collective: the first frame outside ``zerospeed/comm``."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _COMM_DIR:
        frame = frame.f_back  # type: ignore[assignment]
    return frame.f_code.co_name if frame is not None else "?"


class CommsLogger:
    """Counts per collective kind; ``enabled`` switches off only the per-size detail and printing.

    ``debug`` (DeepSpeed's ``comms_logger.debug``) adds the calling function's name to each verbose line
    and counts the calls per caller in the summary.
    """

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.prof_ops: list[str] = []
        self.debug = False
        self.stats: dict[str, OpStats] = {}

    def configure(self, enabled: bool, verbose: bool = False, prof_all: bool = True, prof_ops: list[str] | None = None,
                  debug: bool = False) -> None:
        self.enabled = enabled
        self.verbose = verbose
        self.prof_all = prof_all
        self.prof_ops = list(prof_ops or [])
        self.debug = debug

    def start_profiling_comms(self) -> None:
        """DeepSpeed's switch: profile every op kind from now on (``prof_all``)."""
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        """DeepSpeed's switch: profile only the ``prof_ops`` kinds from now on."""
        self.prof_all = False

    def record(self, op: str, nbytes: int, volume: int, seconds: float = 0.0,
               ranks: tuple[int, ...] | None = None) -> None:
        st = self.stats.setdefault(op, OpStats())
        st.count += 1
        st.bytes += nbytes
        st.volume += volume
        st.seconds += seconds
        if ranks is not None:
            st.groups[ranks] = st.groups.get(ranks, 0) + nbytes
        if self.enabled and (self.prof_all or op in self.prof_ops):
            st.sizes[nbytes] = st.sizes.get(nbytes, 0) + 1
            caller = caller_function() if self.debug else ""
            if caller:
                st.callers[caller] = st.callers.get(caller, 0) + 1
            if self.verbose:
                where = f" | [Caller Func: {caller}]" if caller else ""
                print(f"[comm] {op}{where} {nbytes} bytes {seconds * 1e3:.3f} ms", flush=True)

    def add_time(self, op: str, seconds: float) -> None:
        self.stats.setdefault(op, OpStats()).seconds += seconds

    def reset(self) -> None:
        self.stats.clear()

    def snapshot(self) -> dict[str, OpStats]:
        return {k: OpStats(v.count, v.bytes, v.volume, v.seconds, dict(v.sizes), dict(v.callers), dict(v.groups))
                for k, v in self.stats.items()}

    def total_volume(self) -> int:
        return sum(s.volume for s in self.stats.values())

    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.stats.values())

    def summary(self, world_size: int = 1) -> str:
        """A table: op, count, message bytes, volume, seconds, algorithmic and bus bandwidth."""
        lines = [f"{'op':<16}{'count':>8}{'msg MB':>12}{'volume MB':>12}{'time s':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
        for op, st in sorted(self.stats.items()):
            algbw = st.bytes / st.seconds / 1e9 if st.seconds > 0 else 0.0
            factor = _bus_factor(op, world_size)
            lines.append(
                f"{op:<16}{st.count:>8}{st.bytes / 1e6:>12.3f}{st.volume / 1e6:>12.3f}{st.seconds:>10.4f}"
                f"{algbw:>12.3f}{algbw * factor:>12.3f}"
            )
            for caller, count in sorted(st.callers.items()):
                lines.append(f"  [Caller Func: {caller}] {count} calls")
        return "\n".join(lines)


def _bus_factor(op: str, n: int) -> float:
    if n <= 1:
        return 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


# The process default: every collective counts here (DeepSpeed's module-level ``deepspeed.comm`` logger and
# its summary read it). An engine's own logger also counts the collectives issued inside its calls.
COMMS_LOGGER = CommsLogger()
# The logger of the engine whose forward/backward/step is running (``recording``), None outside one.
_ENGINE_LOGGER: ContextVar[CommsLogger | None] = ContextVar("zerospeed_engine_comms", default=None)


@contextmanager
def recording(logger: CommsLogger) -> Iterator[None]:
    """Collectives issued inside also count in ``logger`` (an engine's own), beside the process default."""
    token = _ENGINE_LOGGER.set(logger)
    try:
        yield
    finally:
        _ENGINE_LOGGER.reset(token)


def loggers() -> tuple[CommsLogger, ...]:
    """Where a collective issued now is counted: the process default, and the running engine's logger."""
    own = _ENGINE_LOGGER.get()
    return (COMMS_LOGGER,) if own is None or own is COMMS_LOGGER else (COMMS_LOGGER, own)


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0
