"""One background writer per engine: training goes on while the previous checkpoint is written.

The training thread only takes a snapshot (CPU copies of this rank's tensors, JSON of the small state);
the writer thread writes the files, hashes them and publishes this rank's marker; on rank 0 it then waits
for every rank's marker on the file system and commits. The writer issues no collectives, so it can never
interleave with the training thread's collectives. At most one save is in flight: the next save (or a
load, or ``wait``) first waits for it and re-raises any error it met.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class SaveStats:
    """Seconds the training thread was blocked, seconds of writing, and bytes written by this rank."""

    path: str
    stall_s: float
    write_s: float = 0.0
    bytes: int = 0
    done: bool = False


class BackgroundWriter:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: SaveStats | None = None

    def submit(self, job: Callable[[], int], stats: SaveStats) -> None:
        self.wait()
        self.last = stats

        def run() -> None:
            t0 = time.perf_counter()
            try:
                stats.bytes = job()
                stats.done = True
            except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread by wait()
                self._error = exc
            stats.write_s = time.perf_counter() - t0

        # Not a daemon: an interpreter that exits normally finishes the write first.
        self._thread = threading.Thread(target=run, name="zerospeed-checkpoint-writer", daemon=False)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Any:
        """Block until the in-flight save (if any) is written; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"the background checkpoint save failed: {exc}") from exc
        return self.last
