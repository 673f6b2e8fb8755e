"""``--shutdown-timeout`` when a rank fails: torchrun's own wait is fixed, ours is enforced here.

When a rank fails, torch 2.13's agent stops the others with SIGTERM and waits a fixed 30 s before SIGKILL
(``_stop_workers`` ignores its ``shutdown_timeout``). A rank that is hung - stopped, or spinning in native
code - ignores SIGTERM, so the job would end 30 s after the failure whatever the user asked. The launcher
watches for the moment the agent starts stopping ranks (its ``Sending process ... closing signal`` log
line, or a rank's failure report); ``timeout_s`` later it SIGKILLs every rank still alive, with its process
group. A rank killed that way that had not reported a failure itself is *hung*: it never got to the
collective the others timed out in, which makes it the likely cause (``failures.py`` names it first).
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, field

_CLOSING = re.compile(r"Sending process \d+ closing signal SIG[A-Z]+")


@dataclass
class HungRank:
    """A rank still alive ``timeout_s`` after the agent began stopping ranks; ``state``: psutil's status."""

    rank: int
    state: str


@dataclass
class ShutdownDeadline:
    """Call ``poll(stderr_tail)`` every monitor tick while torchrun runs."""

    launch_dir: str
    timeout_s: float
    started: float | None = None
    hung: list[HungRank] = field(default_factory=list)
    _done: bool = False

    def _failure_seen(self, stderr_tail: str) -> bool:
        if _CLOSING.search(stderr_tail):
            return True
        try:
            return any(n.startswith("rank_") and n.endswith(".err") for n in os.listdir(self.launch_dir))
        except OSError:
            return False

    def poll(self, stderr_tail: str) -> None:
        if self._done:
            return
        now = time.monotonic()
        if self.started is None:
            if self._failure_seen(stderr_tail):
                self.started = now
            return
        if now - self.started >= self.timeout_s:
            self._done = True
            self.hung = kill_alive_ranks(self.launch_dir)


def kill_alive_ranks(launch_dir: str) -> list[HungRank]:
    """SIGKILL (with their groups) the recorded ranks still alive; return those that reported no failure."""
    import psutil  # only needed here; keeps `zerospeed --help` light

    from zerospeed.launcher.failures import read_rank_pids

    reported = {n[len("rank_"):-len(".err")] for n in os.listdir(launch_dir) if n.startswith("rank_") and n.endswith(".err")}
    hung: list[HungRank] = []
    for rank, pid in sorted(read_rank_pids(launch_dir).items()):
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
