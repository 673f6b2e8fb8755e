"""The monitor interface: ``write_events([(name, value, step), ...])``, tensorboard-style tuples."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from ... import comm
from ...config.errors import ConfigError

Event = tuple[str, float, int]


def import_optional(module: str, section: str, install: str) -> Any:
    """An optional monitor package, or a ``ConfigError`` naming ``<section>.enabled`` and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{section}.enabled", f"is true but the '{module}' package is not installed; `{install}` or "
                                                f"set {section}.enabled to false") from exc


def writes_here(enabled: bool, rank: int | None) -> bool:
    """DeepSpeed's rule for a monitor built directly from its section: it opens files or sessions and writes only
    when the section is enabled and on rank 0 (``rank=None``: this process's rank, 0 without a process group)."""
    return enabled and (comm.get_rank() if rank is None else rank) == 0


class Monitor:
    """A sink for scalar events. The base class is the disabled monitor: it accepts and drops events."""

    enabled: bool = False

    def write_events(self, events: Sequence[Event]) -> None:
        """Record each ``(name, value, step)``."""

    def flush(self) -> None:
        """Push buffered events to storage."""

    def close(self) -> None:
        """Flush and release files or sessions."""
        self.flush()


def check_event(event: Event) -> Event:
    """Validate one event tuple; a malformed event is a caller bug worth a clear message."""
    if not isinstance(event, tuple | list) or len(event) != 3:
        raise ValueError(f"a monitor event is (name, value, step), got {event!r}")
    name, value, step = event
    if not isinstance(name, str):
        raise ValueError(f"monitor event name must be a str, got {name!r}")
    return name, float(value), int(step)


class MonitorMaster(Monitor):
    """Fans events out to every enabled backend (DeepSpeed's ``MonitorMaster``)."""

    def __init__(self, monitors: Sequence[Monitor]) -> None:
        self.monitors = [m for m in monitors if m.enabled]
        self.enabled = bool(self.monitors)

    def write_events(self, events: Sequence[Event]) -> None:
        if not self.monitors:
            return
        checked = [check_event(e) for e in events]
        for monitor in self.monitors:
            monitor.write_events(checked)

    def flush(self) -> None:
        for monitor in self.monitors:
            monitor.flush()

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
