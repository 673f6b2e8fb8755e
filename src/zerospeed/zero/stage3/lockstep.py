"""Ranks that diverge are named, not hung: every stage-3 all-gather is checked to be the same on all ranks.

Under ZeRO-3 every rank must gather the same parameters in the same order. A rank that takes another
path (an early exit, a data-dependent branch, a ``generate`` loop of another length) would otherwise
pair its all-gathers with different ones on its peers: garbage when the sizes match, a Gloo abort
(``Received data size doesn't match``) or a hang when they do not.

So before each all-gather of partitioned parameters the ranks exchange a *fingerprint*: seven integers
(pass number, phase, position in the pass, gather or end of forward, module being run, first
parameter gathered, elements). Under DeepCompile one exchange at the start of each compiled graph stands for
all of that graph's gathers (:meth:`Lockstep.check_schedule`). The
exchange is one tiny all-gather of fixed size, so it pairs safely whatever each rank is doing. At the
end of a forward that gathered anything the ranks exchange an "end of forward" fingerprint as well, so
a rank that finished early meets its peers' next gather there. On any difference every rank raises
:class:`RanksDivergedError` with the same message naming what each rank was gathering. A rank whose
peers never join (they run other collectives, or fewer forwards and then something else) fails at the
collective timeout (``comms_timeout_s``) with the same error naming what it was doing.

Passes are numbered by the forwards that gathered anything (a forward that finds everything gathered,
e.g. inside ``GatheredParameters``, is not collective and may differ per rank). Phases: a training forward (grad enabled), a no-grad forward, a backward, or outside any pass
(``GatheredParameters``, saving).
"""

from __future__ import annotations

from collections.abc import Sequence

from ... import comm
from .param_store import ParamShard

PHASES = ("outside a forward/backward", "training forward", "no-grad forward", "backward")
OUTSIDE, TRAIN_FORWARD, NOGRAD_FORWARD, BACKWARD = range(4)
GATHER, END_OF_FORWARD, SCHEDULE = 0, 1, 2

HINT = ("Under ZeRO stage 3 every rank must run the same modules in the same order (parameters are gathered "
        "collectively). Code whose path differs per rank (an early exit, a data-dependent branch, a generate "
        "loop of different length) must keep the ranks in step: use zerospeed.zero.synced_generate(...) or the "
        "zerospeed.zero.any_rank_running(done) loop (finished ranks keep running forwards until all are done), "
        "or run it inside `with zerospeed.zero.GatheredParameters(model.parameters()):` (nothing is gathered "
        "there). See docs/zero3.md, 'Ranks that run different code'.")


class RanksDivergedError(comm.CollectiveError):
    """Stage-3 ranks gathered different parameters (or one waited for a gather its peers never made)."""


class Lockstep:
    """The running position of this rank's stage-3 gathers, exchanged before each one."""

    def __init__(self, group: comm.Group | None, shards: Sequence[ParamShard], param_names: Sequence[str],
                 unit_names: Sequence[str]) -> None:
        self.group = group
        self.world = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.index = {id(s): i for i, s in enumerate(shards)}
        self.param_names = list(param_names)
        self.unit_names = list(unit_names)
        self.pass_no = 0
        self._settled_pass = 0  # pass_no after the last pass every rank completed (restored by reset())
        self.phase = OUTSIDE
        self.seq = 0
        self.unit = -1  # the module being run (unit index), -1 when none
        # Off: no exchange (one tiny synchronous all-gather per gather less), and no protection either.
        self.enabled = True
        # Set while a DeepCompile graph op gathers under a schedule every rank checked at the graph's start
        # (check_schedule): the gather is counted, not exchanged.
        self.covered = False

    # --- position ------------------------------------------------------------------------------------
    def begin_forward(self, grad: bool) -> None:
        self.phase = TRAIN_FORWARD if grad else NOGRAD_FORWARD
        self.seq = 0
        self.unit = -1

    def end_forward(self, grad: bool) -> None:
        """Meet the peers at the end of a forward that gathered anything, then enter backward (or leave)."""
        if self.seq:
            self._exchange([self.pass_no, self.phase, self.seq, END_OF_FORWARD, -1, -1, 0])
        self.phase = BACKWARD if grad else OUTSIDE
        self.seq = 0
        self.unit = -1
        if not grad:
            self._settled_pass = self.pass_no

    def end_backward(self) -> None:
        self.phase = OUTSIDE
        self.seq = 0
        self.unit = -1
        self._settled_pass = self.pass_no

    def reset(self) -> None:
        """After an abandoned step: back to the last pass all ranks completed (a rank that failed before its
        first gather of the pass did not count it; its peers did)."""
        self.pass_no = self._settled_pass
        self.phase = OUTSIDE
        self.seq = 0
        self.unit = -1

    def before_gather(self, shards: Sequence[ParamShard]) -> None:
        """Check that every rank is about to gather the same thing (raises RanksDivergedError if not)."""
        if self.seq == 0 and self.phase in (TRAIN_FORWARD, NOGRAD_FORWARD):
            self.pass_no += 1  # counts the forwards that gather (one that gathers nothing is not collective)
        self.seq += 1
        if self.covered:
            return
        first = self.index.get(id(shards[0]), -1)
        self._exchange([self.pass_no, self.phase, self.seq, GATHER, self.unit, first, sum(s.numel for s in shards)])

    def check_schedule(self, ops: int, digest: int) -> bool:
        """At the start of a compiled graph (DeepCompile): every rank is about to run the same ``ops`` gathers
        and prefetches in the same order (``digest`` of their sequence, from the graph pass). A compiled graph
        has no branch, so the gathers inside need no exchange of their own; ranks that compiled different
        graphs (guards that chose differently: a data-dependent branch) differ here. Returns whether the
        check ran (off, or world 1: it did not, and nothing is covered)."""
        self.seq += 1
        if self.world == 1 or not self.enabled:
            return False
        self._exchange([self.pass_no, self.phase, self.seq, SCHEDULE, -1, ops, digest])
        return True

    # --- the exchange ------------------------------------------------------------------------------
    def _exchange(self, row: list[int]) -> None:
        if self.world == 1 or not self.enabled:
            return
        try:
            rows = comm.exchange_ints(row, group=self.group)
        except RanksDivergedError:
            raise
        except comm.CollectiveError as exc:
            text = str(exc).lower()
            if "closed by peer" in text or "connection reset" in text:
                raise  # a peer abandoned the step (or died): the plain collective error says so
            raise RanksDivergedError(
                f"rank {self.rank}: ZeRO-3 rank {self.rank} was at {self.describe(row)} when its peers did not "
                f"join (within comms_timeout_s, or they failed): they run other code (a different number of "
                f"forwards, another branch) or are hung or dead.\n{HINT}\n{exc}") from exc
        if any(r != rows[0] for r in rows):
            same = len({tuple(r[:3]) for r in rows}) == 1
            where = f"{PHASES[rows[0][1]]} pass {rows[0][0]}, gather #{rows[0][2]}" if same else "at different points"
            if same and all(r[3] == SCHEDULE for r in rows):
                where = f"DeepCompile, check #{rows[0][2]}"
            doing = "; ".join(f"rank {r}: {self.describe(x)}" for r, x in enumerate(rows))
            raise RanksDivergedError(f"rank {self.rank}: ZeRO-3 ranks diverged ({where}): {doing}.\n{HINT}")

    def describe(self, row: Sequence[int]) -> str:
        """Words for a fingerprint row (every rank has the same model, so indices name the same things)."""
        pass_no, phase, seq, what, unit, first, numel = row
        where = f"{PHASES[phase] if 0 <= phase < len(PHASES) else '?'} pass {pass_no}"
        if what == END_OF_FORWARD:
            return f"the end of {where}, after {seq} gathers"
        if what == SCHEDULE:
            return f"the start of a compiled graph ({first} gathers and prefetches, schedule {numel:#x})"
        module = f" for module '{self.unit_names[unit]}'" if 0 <= unit < len(self.unit_names) else ""
        param = self.param_names[first] if 0 <= first < len(self.param_names) else "?"
        return f"gather #{seq} of {where}{module} ('{param}', {numel} elements)"


__all__ = ["Lockstep", "RanksDivergedError"]
