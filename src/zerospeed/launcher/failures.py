"""Which ranks failed, how, and the one-line summary ``zerospeed launch`` prints about it.

Two sources, merged per rank:

- the ranks' own reports (``rank_<RANK>.err``, written by ``rank_entry.py``): exit code, precise time,
  error line and traceback tail, for every failure Python sees (an exception, ``sys.exit(n)``);
- torchrun's failure table (``rank : 1 (local_rank: 1)`` / ``exitcode : 3 (pid: ...)``, printed on
  stderr when a worker fails): the exit code of every failed rank, including those that died without
  Python noticing (``os._exit``, a signal) and those the agent stopped with SIGTERM after the first
  failure, and which rank torchrun saw fail first ("Root Cause").

A rank that ended by SIGTERM, wrote no report and is not the root cause was *stopped* by the agent
because another rank failed: it is listed as stopped, not as failing.
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
    reports: dict[int, RankFailure], agent: dict[int, RankFailure]
) -> tuple[list[RankFailure], list[int]]:
    """Return (failing ranks, first failure first; ranks stopped by the agent)."""
    merged: dict[int, RankFailure] = {}
    for rank in sorted(set(reports) | set(agent)):
        report, seen = reports.get(rank), agent.get(rank)
        failure = report or RankFailure(rank)
        if seen is not None:
            failure.root_cause = seen.root_cause
            if seen.exitcode is not None:
                failure.exitcode = seen.exitcode
        merged[rank] = failure
    stopped = sorted(
        r for r, f in merged.items()
        if f.exitcode == -signal.SIGTERM and r not in reports and not f.root_cause
    )
    failing = [f for r, f in merged.items() if r not in stopped]
    # Reports carry precise times; torchrun's root cause (1 s resolution) decides only for a rank that died
    # without a report (os._exit, a signal), which is then the likely cause of the others' errors.
    failing.sort(key=lambda f: (not (f.root_cause and f.time is None), f.time or float("inf"), f.rank))
    return failing, stopped


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
