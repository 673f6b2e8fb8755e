"""Gathering modules' parameters when needed, and prefetching the next ones in the recorded order.

A :class:`Unit` is the set of partitioned parameters one module owns directly (plus any registered as
external to it): one all-gather brings it in. A unit is *held* for reasons (``forward``, ``backward``);
its parameters are released when the last reason goes and no other holder keeps them.

Prefetch: during the first training step (forward and backward with grad enabled) the fetcher records
the order in which units are acquired. On later passes, when unit ``k`` of the recorded order is acquired,
one asynchronous gather is launched for the units after it, up to ``prefetch_numel`` elements ahead and
never beyond ``max_live_numel`` gathered elements, so the collective overlaps the current module's
compute. As soon as execution leaves the recorded order, prefetch stops for the rest of that pass; every
rank sees the same order, so every rank issues the same collectives.

Under parameter offload to disk, reads run further ahead than gathers: when unit ``k`` is acquired, the
home starts reading the shards of the units after it, up to its ``read_ahead_numel`` elements, so the
disk works while the current module computes and the next gathers find their shards already read.

Reuse (DeepSpeed's ``stage3_max_reuse_distance``): once the order is recorded, a unit that stops being
held does not release a parameter that a unit within the next ``max_reuse_numel`` elements of the
recorded order (forward, then backward) uses again: it stays gathered, unheld ("kept"), so a layer
applied twice in a forward, or the last layers between forward and backward, are gathered once. The
walk stops before the first unit reached with ``max_reuse_numel`` elements already passed (0: release
always). Kept parameters count as live: none is kept while more than ``max_live_numel`` elements are
gathered. Everything is released at the end of backward, and at the end of a forward that did not
follow the recorded order with grad enabled.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .lockstep import Lockstep
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
                 max_live_numel: int, home: ShardHome | None = None, max_reuse_numel: int = 0) -> None:
        self.units = list(units)
        self.max_reuse_numel = max_reuse_numel
        self.kept: dict[int, ParamShard] = {}  # gathered, unheld, because a unit soon uses them again
        self._reuse: dict[tuple[int, str, int, int], set[int]] = {}  # the recorded order is fixed: walk once
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
        self.lockstep: Lockstep | None = None  # the ranks' gather sequences checked against each other

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
        if self.lockstep is not None:
            self.lockstep.unit = unit.index
        if track:
            self._record_and_prefetch(unit, reason)
        ensure_gathered(unit.shards, quantize=True)

    def release(self, unit: Unit, reason: str) -> None:
        if reason not in unit.reasons:
            return
        unit.reasons.discard(reason)
        if unit.reasons:
            return
        keep = self._reused_soon(unit, reason)
        for s in unit.shards:
            s.holders.discard(unit)
            if id(s) not in keep:
                self._release(s)
        live = self.live_numel()
        for s in unit.shards:
            if id(s) in keep and not s.holders and s.state is ShardState.GATHERED:
                if live > self.max_live_numel:
                    self._release(s)
                    live -= s.numel
                else:
                    self.kept[id(s)] = s

    def _release(self, s: ParamShard) -> None:
        self.kept.pop(id(s), None)
        s.release()

    def _reused_soon(self, unit: Unit, reason: str) -> set[int]:
        """Ids of ``unit``'s shards used again within ``max_reuse_numel`` elements of the recorded order."""
        pos = self.cursor[reason]
        if self.max_reuse_numel <= 0 or self.recording or pos is None:
            return set()
        if reason == FORWARD and not torch.is_grad_enabled():
            return set()  # an untracked (no-grad) forward: not following the recorded order
        key = (unit.index, reason, pos, self.max_reuse_numel)
        if key not in self._reuse:
            self._reuse[key] = self._walk(unit, reason, pos)
        return self._reuse[key]

    def _walk(self, unit: Unit, reason: str, pos: int) -> set[int]:
        ahead = self.traces[reason][pos:] + (self.traces[BACKWARD] if reason == FORWARD else [])
        mine = {id(s) for s in unit.shards}
        keep: set[int] = set()
        walked = 0
        for index in ahead:
            if walked >= self.max_reuse_numel or keep == mine:
                break
            nxt = self.units[index]
            keep.update(id(s) for s in nxt.shards if id(s) in mine)
            walked += nxt.numel
        return keep

    def on_grad(self, shard: ParamShard) -> None:
        """A parameter's gradient is complete: release units whose trainable parameters all arrived."""
        for unit in self.units_of.get(id(shard), ()):
            unit.arrived.add(id(shard))
            if BACKWARD in unit.reasons and unit.trainable() <= unit.arrived:
                self.release(unit, BACKWARD)

    # --- pass boundaries ---------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self.cursor[FORWARD] = 0
        if self.lockstep is not None:
            self.lockstep.begin_forward(torch.is_grad_enabled())

    def end_forward(self, clean: bool = True) -> None:
        """The root module's forward returned (``clean``) or raised."""
        on_trace = torch.is_grad_enabled() and not self.recording and self.cursor[FORWARD] is not None
        self._drain(keep_kept=on_trace)
        self.cursor[BACKWARD] = 0
        if self.lockstep is not None and clean:
            self.lockstep.end_forward(torch.is_grad_enabled())

    def end_backward(self) -> None:
        self.cursor[BACKWARD] = None  # nothing is reused after backward: release everything
        for unit in self.units:
            self.release(unit, BACKWARD)
            unit.arrived.clear()
        self._drain()
        if self.recording and self.traces[BACKWARD]:
            self.recording = False
        self.cursor[BACKWARD] = 0
        if self.lockstep is not None:
            self.lockstep.end_backward()

    def reset(self) -> None:
        """After an error: forget every hold and gather in flight (not waited for: their group is being
        dropped) and free what was gathered. A trace still being recorded starts again."""
        for unit in self.units:
            unit.reasons.clear()
            unit.arrived.clear()
        self.inflight.clear()
        self.kept.clear()
        if self.lockstep is not None:
            self.lockstep.reset()
        for s in self.shards:
            s.abandon()
        if self.recording:
            self.traces = {FORWARD: [], BACKWARD: []}
        self.cursor = {FORWARD: 0, BACKWARD: 0}

    def release_unheld(self) -> None:
        """DeepSpeed's ``empty_partition_cache``: finish gathers in flight and release every gathered parameter
        that no unit holds (kept for reuse, prefetched); those held (a forward under way, ``GatheredParameters``)
        stay. The next use gathers again."""
        self._drain()

    def _drain(self, keep_kept: bool = False) -> None:
        """Finish gathers still in flight and release what nobody holds (so no collective stays open)."""
        for op in self.inflight:
            op.finish()
        self.inflight.clear()
        for s in self.shards:
            if not (keep_kept and id(s) in self.kept):
                self._release(s)

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
        todo: dict[int, ParamShard] = {}  # gathered together: one collective (and one lockstep check)
        for j in range(pos + 1, len(trace)):
            nxt = [s for s in self.units[trace[j]].shards if id(s) not in todo]
            cost = sum(s.numel for s in nxt if s.state is not ShardState.GATHERED)
            if ahead + cost > self.prefetch_numel or live + cost > self.max_live_numel:
                break
            ahead += cost
            live += cost
            todo.update((id(s), s) for s in nxt if s.state is ShardState.SHARDED)
        if todo:
            self.inflight.extend(start_gather(todo.values(), async_op=True, quantize=True))
            self.prefetched_numel += sum(s.numel for s in todo.values())

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
