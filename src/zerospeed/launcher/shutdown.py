"""``--shutdown-timeout`` when a rank fails: torchrun's own wait is fixed, ours is enforced here.

When a rank fails, torch 2.13's agent stops the others with SIGTERM and waits a fixed 30 s before SIGKILL
(``_stop_workers`` ignores its ``shutdown_timeout``). A rank that is hung - stopped, or spinning in native
code - ignores SIGTERM, so the job would end 30 s after the failure whatever the user asked. The launcher
watches for the moment the agent starts stopping ranks (its ``Sending process ... closing signal`` log
line); ``timeout_s`` later it SIGKILLs every rank still alive, with its process
group. A rank killed that way that had not reported a failure itself is *hung*: it never got to the
collective the others timed out in, which makes it the likely cause (``failures.py`` names it first).
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, field

_CLOSING = re.compile(r"Sending process (\d+) closing signal SIG[A-Z]+")


@dataclass
class HungRank:
    """A rank still alive ``timeout_s`` after the agent began stopping ranks; ``state``: psutil's status."""

    rank: int
    state: str


def _reports(launch_dir: str) -> set[tuple[str, int]]:
    """``(file name, mtime)`` of the ranks' failure reports."""
    out: set[tuple[str, int]] = set()
    try:
        for name in os.listdir(launch_dir):
            if name.startswith("rank_") and name.endswith(".err"):
                out.add((name, os.stat(os.path.join(launch_dir, name)).st_mtime_ns))
    except OSError:
        pass
    return out


@dataclass
class ShutdownDeadline:
    """Call ``poll(stderr_tail)`` every monitor tick while torchrun runs.

    Each new failure (a pid torchrun sends a closing signal to) starts a deadline
    for the ranks alive *then* (their pids): a group torchrun restarts meanwhile (``--max_restarts``) has
    new pids and is never touched."""

    launch_dir: str
    timeout_s: float
    started: float | None = None
    hung: list[HungRank] = field(default_factory=list)
    _seen: set[object] = field(default_factory=set)
    _pids: dict[int, int] = field(default_factory=dict)

    def _new_failure(self, stderr_tail: str) -> bool:
        # Only torchrun's closing signal starts the clock: a failing rank still on its way out (its report
        # written, Python shutting down) is not cut short, and keeps its own exit code.
        now = {int(m.group(1)) for m in _CLOSING.finditer(stderr_tail)}
        fresh = bool(now - self._seen)
        self._seen |= now
        return fresh

    def poll(self, stderr_tail: str) -> None:
        fresh = self._new_failure(stderr_tail)
        now = time.monotonic()
        if self.started is None:
            if fresh:
                from zerospeed.launcher.failures import read_rank_pids

                self.started, self._pids = now, read_rank_pids(self.launch_dir)
            return
        if now - self.started >= self.timeout_s:
            self.hung += kill_alive_ranks(self.launch_dir, self._pids)
            self.started = None


def kill_alive_ranks(launch_dir: str, pids: dict[int, int]) -> list[HungRank]:
    """SIGKILL (with their groups) the ranks of ``pids`` still alive; return those that reported no failure."""
    import psutil  # only needed here; keeps `zerospeed --help` light

    reported = {name[len("rank_"):-len(".err")] for name, _ in _reports(launch_dir)}
    hung: list[HungRank] = []
    for rank, pid in sorted(pids.items()):
        try:
            proc = psutil.Process(pid)
            state = proc.status()
            if state == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                proc.kill()
        except (OSError, psutil.Error):
            continue
        if str(rank) not in reported:
            hung.append(HungRank(rank, state))
    return hung
