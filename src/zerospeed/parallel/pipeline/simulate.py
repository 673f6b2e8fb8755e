"""Timing a schedule without running it: the bubble a schedule implies for given per-stage compute times.

Every stage walks its own instruction list with a local clock. A forward or backward advances the clock
by that stage's (per-chunk) time; a send stamps the message with the sender's clock and costs nothing; a
receive waits until its message exists (FIFO per channel, as the engine's tagged p2p). With equal times
on every stage ``TrainSchedule`` gives exactly the textbook bubble ``(p - 1) / (m + p - 1)``; with measured
per-stage times it gives the bubble the schedule *should* show on that model, to compare with the
bubble the engine measures. ``noise`` (a factor drawn per forward/backward) adds the jitter a real machine
has: 1F1B's steady state has no slack, so under jitter its bubble grows with ``m`` (``eager.py``).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from .schedule import BackwardPass, ForwardPass, PipeSchedule, RecvActivation, RecvGrad, SendActivation, SendGrad


@dataclass(frozen=True)
class Timeline:
    makespan: float
    busy: list[float]  # compute seconds per stage
    ends: list[float]  # per stage: when its last forward/backward ended (the first stage's is the makespan)

    @property
    def bubble(self) -> list[float]:
        """Idle fraction of each stage over the whole pipelined part of the batch."""
        return [1.0 - b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy]


def simulate(schedules: list[PipeSchedule], forward: list[float], backward: list[float], chunks: int = 1,
             noise: Callable[[], float] | None = None) -> Timeline:
    """``forward[s]`` / ``backward[s]``: seconds of one micro-batch through all of stage s's layers, each
    multiplied by a fresh ``noise()`` when given."""
    p = len(schedules)
    programs = [[c for step in s for c in step] for s in schedules]
    pcs = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    ends = [0.0] * p
    queues: dict[tuple[str, int, int], deque[float]] = defaultdict(deque)

    def dest(r: int, c: int, fwd: bool) -> tuple[int, int]:
        vs = c * p + r + (1 if fwd else -1)
        return vs % p, vs // p

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pcs[r] < len(programs[r]):
                cmd = programs[r][pcs[r]]
                c = getattr(cmd, "chunk", 0)
                if isinstance(cmd, (RecvActivation, RecvGrad)):
                    q = queues[("act" if isinstance(cmd, RecvActivation) else "grad", r, c)]
                    if not q:
                        break
                    clock[r] = max(clock[r], q.popleft())
                elif isinstance(cmd, (SendActivation, SendGrad)):
                    fwd = isinstance(cmd, SendActivation)
                    dr, dc = dest(r, c, fwd)
                    queues[("act" if fwd else "grad", dr, dc)].append(clock[r])
                elif isinstance(cmd, (ForwardPass, BackwardPass)):
                    t = (forward[r] if isinstance(cmd, ForwardPass) else backward[r]) / chunks
                    if noise is not None:
                        t *= noise()
                    clock[r] += t
                    busy[r] += t
                    ends[r] = clock[r]
                pcs[r] += 1
                progress = True
    stuck = [r for r in range(p) if pcs[r] < len(programs[r])]
    if stuck:
        raise RuntimeError(f"schedule deadlocks: stages {stuck} wait at {[programs[r][pcs[r]] for r in stuck]}")
    return Timeline(max(clock), busy, ends)
