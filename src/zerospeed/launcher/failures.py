"""Which ranks failed, how, and the one-line summary ``zerospeed launch`` prints about it.

Two sources, merged per rank:

- the ranks' own reports (``rank_<RANK>.err``, written by ``rank_entry.py``): exit code, precise time,
  error line and traceback tail, for every failure Python sees (an exception, ``sys.exit(n)``);
- torchrun's failure table (``rank : 1 (local_rank: 1)`` / ``exitcode : 3 (pid: ...)``, printed on
  stderr when a worker fails): the exit code of every failed rank, including those that died without
  Python noticing (``os._exit``, a signal) and those the agent stopped with SIGTERM after the first
  failure, and which rank torchrun saw fail first ("Root Cause").

Who was *stopped* rather than failing: torchrun logs ``Sending process <pid> closing signal SIGTERM`` for
every rank still running when it saw the first failure; with the pids the ranks recorded
(``rank_<RANK>.pid``) those ranks are listed as stopped, whatever they did on the way out (a SIGTERM handler
exiting 143 or raising), and never blamed. The ranks left all ended within one monitor interval of the
first failure: one that died without a report (a crash, a signal, ``os._exit``) is named before those whose
Python error came after it (often only its echo: "connection closed by peer"), then by report time.
Without that log line (torch logging silenced) a rank that ended by SIGTERM, wrote no report and is not
torchrun's root cause counts as stopped.
"""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import dataclass, field

_TABLE_ROW = re.compile(
    r"\brank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE
)
_ROOT_CAUSE = "Root Cause"
_CLOSING = re.compile(r"Sending process (\d+) closing signal (SIG[A-Z]+)")
_AGENT_FAILED = re.compile(r"\bfailed \(exitcode: -?\d+\) local_rank: \d+ \(pid: \d+\)")  # torchrun's error log
TAIL_LINES = 8


@dataclass
class RankFailure:
    """How one rank ended: ``exitcode`` as the agent saw it (negative: killed by that signal)."""

    rank: int
    exitcode: int | None = None
    time: float | None = None
    error: str = ""
    traceback: list[str] = field(default_factory=list)
    root_cause: bool = False

    def describe(self, verb: str = "") -> str:
        """``rank 1 <verb> (exit code 3, ...)``: the code, then what we know of why."""
        if self.exitcode is None:
            code = "exit code unknown"
        elif self.exitcode < 0:
            code = f"killed by signal {_signal_name(-self.exitcode)}"
        else:
            code = f"exit code {self.exitcode}"
        who = f"rank {self.rank}{' ' + verb if verb else ''}"
        if self.error:
            return f"{who} ({code}): {self.error}"
        if self.exitcode is not None and self.exitcode < 0:
            return f"{who} ({code})"
        return f"{who} ({code}, no Python traceback: it ended via os._exit or in native code)"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def parse_torchrun_failures(text: str) -> dict[int, RankFailure]:
    """Read torchrun's ChildFailedError table from its stderr; ``{}`` if there is none."""
    failures: dict[int, RankFailure] = {}
    root_at = text.rfind(_ROOT_CAUSE)
    for match in _TABLE_ROW.finditer(text):
        rank, code = int(match.group(1)), int(match.group(2))
        failure = failures.setdefault(rank, RankFailure(rank))
        failure.exitcode = code
        if root_at >= 0 and match.start() > root_at:
            failure.root_cause = True
    return failures


def parse_closing_signals(text: str) -> set[int]:
    """The pids torchrun sent a closing signal to (it stops every rank still running after a failure)."""
    return {int(m.group(1)) for m in _CLOSING.finditer(text)}


def read_rank_pids(launch_dir: str) -> dict[int, int]:
    """``{rank: pid}`` from the ``rank_<RANK>.pid`` records (the latest start of each rank)."""
    pids: dict[int, int] = {}
    for name in sorted(os.listdir(launch_dir)):
        if name.startswith("rank_") and name.endswith(".pid"):
            try:
                with open(os.path.join(launch_dir, name), encoding="utf-8") as f:
                    info = json.load(f)
                pids[int(info["rank"])] = int(info["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return pids


def read_rank_reports(launch_dir: str) -> dict[int, RankFailure]:
    """Read every ``rank_<RANK>.err`` in ``launch_dir``; unreadable files are skipped."""
    failures: dict[int, RankFailure] = {}
    for name in sorted(os.listdir(launch_dir)):
        if not (name.startswith("rank_") and name.endswith(".err")):
            continue
        try:
            with open(os.path.join(launch_dir, name), encoding="utf-8") as f:
                data = json.load(f)
            rank = int(data["rank"])
            failures[rank] = RankFailure(
                rank=rank,
                exitcode=int(data["exitcode"]),
                time=float(data["time"]),
                error=str(data.get("error", "")),
                traceback=[str(line) for line in data.get("traceback", [])],
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return failures


def merge_failures(
    reports: dict[int, RankFailure], agent: dict[int, RankFailure], closed: set[int] | None = None
) -> tuple[list[RankFailure], list[int]]:
    """Return (failing ranks, first failure first; ranks stopped by the agent).

    ``closed``: the ranks torchrun sent a closing signal to (``None``: unknown, its log line was not seen).
    """
    merged: dict[int, RankFailure] = {}
    for rank in sorted(set(reports) | set(agent)):
        report, seen = reports.get(rank), agent.get(rank)
        failure = report or RankFailure(rank)
        if seen is not None:
            failure.root_cause = seen.root_cause
            if seen.exitcode is not None:
                failure.exitcode = seen.exitcode
        merged[rank] = failure
    if closed is not None:
        stopped = sorted(closed)
        failing = [f for r, f in merged.items() if r not in closed]
        # All of these ended before torchrun began stopping ranks: a death without a report first.
        failing.sort(key=lambda f: (f.time is not None, f.time or 0.0, not f.root_cause, f.rank))
        return failing, stopped
    stopped = sorted(
        r for r, f in merged.items()
        if f.exitcode == -signal.SIGTERM and r not in reports and not f.root_cause
    )
    failing = [f for r, f in merged.items() if r not in stopped]
    # Reports carry precise times; torchrun's root cause (1 s resolution) decides only for a rank that died
    # without a report (os._exit, a signal), which is then the likely cause of the others' errors.
    failing.sort(key=lambda f: (not (f.root_cause and f.time is None), f.time or float("inf"), f.rank))
    return failing, stopped


def stopped_ranks(stderr_tail: str, launch_dir: str) -> set[int] | None:
    """The ranks torchrun stopped, from its log and the ranks' pid records (empty: it stopped none, every
    rank had ended); ``None`` when its log is not there to tell (torch logging silenced)."""
    pids = parse_closing_signals(stderr_tail)
    if not pids and not _AGENT_FAILED.search(stderr_tail):
        return None
    return {rank for rank, pid in read_rank_pids(launch_dir).items() if pid in pids}


def _timed_out(failure: RankFailure) -> bool:
    text = " ".join([failure.error, *failure.traceback]).lower()
    return "timed out" in text or "timeout" in text or "did not join" in text


def blame_hung(failing: list[RankFailure], stopped: list[int], hung: list[tuple[int, str]],
               shutdown_timeout: float) -> tuple[list[RankFailure], list[int]]:
    """Ranks still alive ``shutdown_timeout`` s after the agent began stopping ranks (``hung``: (rank,
    process state)) did not react to SIGTERM. When the first failure is a collective timeout, such a rank is
    the one that never joined: it goes first. Otherwise it only counts as stopped (killed when slow to go)."""
    if not hung:
        return failing, stopped
    ranks = {rank for rank, _ in hung}
    named = [RankFailure(rank, exitcode=-int(signal.SIGKILL), error=(
        f"never joined: hung (process {state}), it ignored SIGTERM for --shutdown-timeout {shutdown_timeout:g} s "
        "and was killed")) for rank, state in hung]
    rest = [f for f in failing if f.rank not in ranks]
    if rest and not _timed_out(rest[0]):  # a crash elsewhere: those ranks were merely slow to stop
        return rest, sorted(set(stopped) | ranks)
    return named + rest, [r for r in stopped if r not in ranks]


def summarize(failing: list[RankFailure], stopped: list[int], agent_exitcode: int) -> str:
    """One headline naming the failing rank(s) and exit codes, then the first failure's traceback tail."""
    if not failing:
        return (
            f"zerospeed launch: torchrun exited with code {agent_exitcode} and no rank reported a failure "
            "(the rendezvous or the agent failed?); see its output above."
        )
    first, others = failing[0], failing[1:]
    headline = f"zerospeed launch: {first.describe('failed')}"
    if others:
        headline += "; also failed: " + "; ".join(f.describe() for f in others)
    if stopped:
        headline += "; stopped: rank" + ("s " if len(stopped) > 1 else " ") + ", ".join(map(str, stopped))
    lines = [headline]
    tail = _traceback_tail(first.traceback)
    if tail:
        lines.append(f"  rank {first.rank} traceback (last lines):")
        lines.extend("    " + line for line in tail)
    return "\n".join(lines)


def _traceback_tail(lines: list[str]) -> list[str]:
    """The last ``TAIL_LINES`` lines of a traceback, starting at a ``File ...`` line when there is one."""
    tail = lines[-TAIL_LINES:]
    for i, line in enumerate(tail):
        if line.lstrip().startswith("File "):
            return tail[i:]
    return tail


def exit_code_for(failing: list[RankFailure], agent_exitcode: int) -> int:
    """The launcher's exit code: the first failing rank's (128+N when killed by signal N), never 0."""
    code = failing[0].exitcode if failing else None
    if code is None or code == 0:
        return agent_exitcode if agent_exitcode > 0 else 1
    return 128 - code if code < 0 else code
