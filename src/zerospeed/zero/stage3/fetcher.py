"""Gathering modules' parameters when needed, and prefetching the next ones in the recorded order.

A :class:`Unit` is the set of partitioned parameters one module owns directly (plus any registered as
external to it): one all-gather brings it in. A unit is *held* for reasons (``forward``, ``backward``);
its parameters are released when the last reason goes and no other holder keeps them.

Prefetch: during the first training step (forward and backward with grad enabled) the fetcher records
the order in which units are acquired. On later passes, when unit ``k`` of the recorded order is acquired,
gathers for the units after it are launched asynchronously, up to ``prefetch_numel`` elements ahead and
never beyond ``max_live_numel`` gathered elements, so the collective overlaps the current module's
compute. As soon as execution leaves the recorded order, prefetch stops for the rest of that pass; every
rank sees the same order, so every rank issues the same collectives.

Under parameter offload to disk, reads run further ahead than gathers: when unit ``k`` is acquired, the
home starts reading the shards of the units after it, up to its ``read_ahead_numel`` elements, so the
disk works while the current module computes and the next gathers find their shards already read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .param_store import GatherOp, ParamShard, ShardHome, ShardState, ensure_gathered, start_gather

_log = logging.getLogger("zerospeed.zero")

FORWARD = "forward"
BACKWARD = "backward"


class Unit:
    def __init__(self, index: int, name: str, shards: Sequence[ParamShard]) -> None:
        self.index = index
        self.name = name
        self.shards = list(shards)
        self.numel = sum(s.numel for s in self.shards)
        self.reasons: set[str] = set()
        self.arrived: set[int] = set()

    def trainable(self) -> set[int]:
        return {id(s) for s in self.shards if s.param.requires_grad}

    def add(self, shard: ParamShard) -> None:
        if all(s is not shard for s in self.shards):
            self.shards.append(shard)
            self.numel += shard.numel


class Fetcher:
    log_trace_warnings = False  # zero_optimization.log_trace_cache_warnings: log when a pass leaves the trace

    def __init__(self, units: Sequence[Unit], shards: Sequence[ParamShard], prefetch_numel: int,
                 max_live_numel: int, home: ShardHome | None = None) -> None:
        self.units = list(units)
        self.home = home
        self.shards = list(shards)
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.recording = True
        self.traces: dict[str, list[int]] = {FORWARD: [], BACKWARD: []}
        self.cursor: dict[str, int | None] = {FORWARD: 0, BACKWARD: 0}
        self.inflight: list[GatherOp] = []
        self.units_of: dict[int, list[Unit]] = {}
        for u in self.units:
            for s in u.shards:
                self.units_of.setdefault(id(s), []).append(u)
        self.prefetched_numel = 0  # counted over the life of the fetcher (for tests and reports)

    def add_unit(self, unit: Unit) -> None:
        self.units.append(unit)
        for s in unit.shards:
            self.units_of.setdefault(id(s), []).append(unit)

    # --- hold / release ----------------------------------------------------------------------------
    def acquire(self, unit: Unit, reason: str, track: bool) -> None:
        """Hold ``unit`` for ``reason``, gathering what is not there; ``track``: record/prefetch order."""
        if reason in unit.reasons:
            return
        unit.reasons.add(reason)
        for s in unit.shards:
            s.holders.add(unit)
        if track:
            self._record_and_prefetch(unit, reason)
        ensure_gathered(unit.shards, quantize=True)

    def release(self, unit: Unit, reason: str) -> None:
        if reason not in unit.reasons:
            return
        unit.reasons.discard(reason)
        if unit.reasons:
            return
        for s in unit.shards:
            s.holders.discard(unit)
            s.release()

    def on_grad(self, shard: ParamShard) -> None:
        """A parameter's gradient is complete: release units whose trainable parameters all arrived."""
        for unit in self.units_of.get(id(shard), ()):
            unit.arrived.add(id(shard))
            if BACKWARD in unit.reasons and unit.trainable() <= unit.arrived:
                self.release(unit, BACKWARD)

    # --- pass boundaries ---------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self.cursor[FORWARD] = 0

    def end_forward(self) -> None:
        self._drain()
        self.cursor[BACKWARD] = 0

    def end_backward(self) -> None:
        for unit in self.units:
            self.release(unit, BACKWARD)
            unit.arrived.clear()
        self._drain()
        if self.recording and self.traces[BACKWARD]:
            self.recording = False
        self.cursor[BACKWARD] = 0

    def _drain(self) -> None:
        """Finish gathers still in flight and release what nobody holds (so no collective stays open)."""
        for op in self.inflight:
            op.finish()
        self.inflight.clear()
        for s in self.shards:
            s.release()

    # --- prefetch ----------------------------------------------------------------------------------
    def live_numel(self) -> int:
        return sum(s.numel for s in self.shards if not s.persistent and s.state is not ShardState.SHARDED)

    def _record_and_prefetch(self, unit: Unit, reason: str) -> None:
        trace = self.traces[reason]
        if self.recording:
            trace.append(unit.index)
            return
        pos = self.cursor[reason]
        if pos is None:
            return
        if pos >= len(trace) or trace[pos] != unit.index:
            self.cursor[reason] = None  # left the recorded order: no more prefetch in this pass
            if self.log_trace_warnings:
                _log.warning("ZeRO-3 trace cache: the %s pass left the recorded module order at '%s' (position "
                             "%d); prefetch stops for the rest of this pass", reason, unit.name, pos)
            return
        self.cursor[reason] = pos + 1
        if self.home is not None:
            self._read_ahead(trace, pos)
        if self.prefetch_numel <= 0:
            return
        self.inflight = [op for op in self.inflight if op.out is not None]
        ahead, live = 0, self.live_numel() + unit.numel
        for j in range(pos + 1, len(trace)):
            nxt = self.units[trace[j]]
            todo = [s for s in nxt.shards if s.state is ShardState.SHARDED]
            cost = sum(s.numel for s in nxt.shards if s.state is not ShardState.GATHERED)
            if ahead + cost > self.prefetch_numel or live + cost > self.max_live_numel:
                break
            ahead += cost
            if todo:
                live += cost
                self.inflight.extend(start_gather(todo, async_op=True, quantize=True))
                self.prefetched_numel += sum(s.numel for s in todo)

    def _read_ahead(self, trace: list[int], pos: int) -> None:
        """Start reading the offloaded shards of the units after ``pos`` (at least the next one)."""
        assert self.home is not None
        ahead = 0
        for j in range(pos + 1, len(trace)):
            todo = [s for s in self.units[trace[j]].shards if s.home is self.home and s.state is ShardState.SHARDED]
            cost = sum(s.shard for s in todo)
            if ahead and ahead + cost > self.home.read_ahead_numel:
                break
            ahead += cost
            self.home.prefetch(todo)
