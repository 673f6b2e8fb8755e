"""Run torchrun as a child process and make sure that, however it ends, no rank outlives the launcher.

- torchrun runs in its own session, so a Ctrl-C in the terminal reaches the launcher only; the launcher
  forwards SIGINT / SIGTERM / SIGHUP to torchrun, which stops the ranks. If torchrun has not exited
  ``grace_s`` seconds after the signal (or a second signal comes), the launcher kills it with SIGKILL.
- On Linux torchrun gets SIGTERM if the launcher itself dies (``PR_SET_PDEATHSIG``).
- torchrun's stderr (which the ranks inherit) is copied through to ours as it comes; the last bytes are
  kept so that torchrun's failure table can be read afterwards (``failures.parse_torchrun_failures``).
- After torchrun exits, every rank that recorded its pid (``rank_<RANK>.pid``) and is still alive is
  killed, with its process group (torchrun starts each rank as a session leader).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from zerospeed.launcher.shutdown import HungRank, ShutdownDeadline

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TAIL_BYTES = 64 * 1024
_PR_SET_PDEATHSIG = 1


@dataclass
class AgentResult:
    """How torchrun ended: its exit code, the signal the launcher received (if any), its stderr tail."""

    exitcode: int
    received_signal: int | None
    stderr_tail: str
    killed_leftovers: list[int]
    hung: list[HungRank] = field(default_factory=list)  # alive --shutdown-timeout after a failure: killed


class _StderrPump(threading.Thread):
    """Copy the child's stderr to ours chunk by chunk, keeping the last ``_TAIL_BYTES`` bytes."""

    def __init__(self, fd: int) -> None:
        super().__init__(name="zerospeed-stderr-pump", daemon=True)
        self._fd = fd
        self._tail = bytearray()

    def run(self) -> None:
        out = getattr(sys.stderr, "buffer", None)
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            self._tail += chunk
            del self._tail[:-_TAIL_BYTES]
            try:
                if out is not None:
                    out.write(chunk)
                    out.flush()
                else:
                    sys.stderr.write(chunk.decode("utf-8", "replace"))
                    sys.stderr.flush()
            except (OSError, ValueError):
                pass  # our stderr is gone; keep draining so the ranks never block on a full pipe

    def tail(self) -> str:
        return bytes(self._tail).decode("utf-8", "replace")


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to send SIGTERM to the child when the launcher dies."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    prctl = ctypes.CDLL(name, use_errno=True).prctl  # loaded here: preexec_fn must not load libraries

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return preexec


def kill_leftover_ranks(launch_dir: str, wait_s: float = 5.0) -> list[int]:
    """Kill (SIGKILL, with their process groups) the ranks still alive; return their rank numbers."""
    import psutil  # only needed here; keeps `zerospeed --help` light

    killed: list[tuple[int, psutil.Process]] = []
    for name in sorted(os.listdir(launch_dir)):
        if not (name.startswith("rank_") and name.endswith(".pid")):
            continue
        try:
            with open(os.path.join(launch_dir, name), encoding="utf-8") as f:
                info = json.load(f)
            proc = psutil.Process(int(info["pid"]))
            if proc.create_time() > float(info["start"]) + 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
                continue  # pid reused by another process, or already dead
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            killed.append((int(info["rank"]), proc))
        except (OSError, ValueError, KeyError, psutil.Error):
            continue
    psutil.wait_procs([p for _, p in killed], timeout=wait_s)
    return [rank for rank, _ in killed]


def run_agent(argv: list[str], env: dict[str, str], launch_dir: str, grace_s: float,
              on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
              shutdown_timeout: float | None = None) -> AgentResult:
    """Run ``argv`` (torchrun) to completion, forwarding signals; then kill any rank left alive.

    ``on_start(proc)`` is called once torchrun runs (the node watch keeps it, to stop torchrun when a
    peer node fails). ``shutdown_timeout``: once a rank failed, the others get that long to exit
    (``shutdown.py``; torchrun's own wait is a fixed 30 s)."""
    proc = subprocess.Popen(
        argv, env=env, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_die_with_parent()
    )
    if on_start is not None:
        on_start(proc)
    assert proc.stderr is not None
    pump = _StderrPump(proc.stderr.fileno())
    pump.start()
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        try:
            proc.send_signal(signal.SIGKILL if len(received) > 1 else signum)
        except OSError:
            pass

    previous = _install_handlers(forward)
    deadline = ShutdownDeadline(launch_dir, shutdown_timeout) if shutdown_timeout is not None else None
    try:
        exitcode = _wait(proc, received, grace_s, lambda: deadline.poll(pump.tail()) if deadline else None)
    finally:
        _restore_handlers(previous)
    leftovers = kill_leftover_ranks(launch_dir)
    pump.join(timeout=2.0)
    proc.stderr.close()
    return AgentResult(exitcode, received[0] if received else None, pump.tail(), leftovers,
                       deadline.hung if deadline else [])


def _wait(proc: subprocess.Popen[bytes], received: list[int], grace_s: float,
          tick: Callable[[], None] = lambda: None) -> int:
    """Wait for ``proc`` (calling ``tick`` every 0.1 s); after a received signal, SIGKILL its process group
    once ``grace_s`` has passed."""
    deadline: float | None = None
    while True:
        try:
            return proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        tick()
        if received and deadline is None:
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            return proc.wait()


def _install_handlers(handler: Callable[[int, FrameType | None], None]) -> dict[int, object]:
    if threading.current_thread() is not threading.main_thread():
        return {}  # signals can only be handled in the main thread; the caller forwards them itself
    return {int(sig): signal.signal(sig, handler) for sig in FORWARDED_SIGNALS}


def _restore_handlers(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]
