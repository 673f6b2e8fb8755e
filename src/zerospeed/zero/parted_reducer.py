"""Optimizer groups that carry their own partition axis (MoE: an expert set's expert-data-parallel group).

``reducer_over_axes`` cuts the optimizer's groups by axis, builds one reducer per axis over that axis's
process group (its ``dp_size`` the axis's size) and puts them behind one reducer interface. The axes are
data (``ShardAxis``), handed in by the builder: nothing here knows which parallelism made them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .grad_reducer import GradReducer, ReducerWiring, ReduceSettings
from .sharded_group import ShardedGroup


@dataclass(frozen=True)
class ShardAxis:
    """The process group an optimizer group is partitioned and reduced over (instead of the data-parallel one)."""

    name: str  # orders the axes the same way on every rank
    group: Any
    size: int


MakeReducer = Callable[[list[ShardedGroup], ReduceSettings, Any, ReducerWiring], Any]


def reducer_over_axes(live: list[ShardedGroup], axes: list[ShardAxis | None], settings: ReduceSettings,
                      dp_group: Any, wiring: ReducerWiring, make: MakeReducer) -> "PartedReducer":
    """One reducer per axis (None: the data-parallel group), data-parallel first, then the axes by name."""
    by_axis: dict[str, list[int]] = {}
    found: dict[str, ShardAxis] = {}
    for gi, axis in enumerate(axes):
        key = "" if axis is None else axis.name
        by_axis.setdefault(key, []).append(gi)
        if axis is not None:
            found[key] = axis
    parts = []
    for n, key in enumerate(sorted(by_axis)):  # the same order on every rank
        idx = by_axis[key]
        group, s = (dp_group, settings) if key == "" else (found[key].group,
                                                             dataclasses.replace(settings, dp_size=found[key].size))
        # each part writes through a view of the sink that numbers its groups as the optimizer does
        pw = dataclasses.replace(wiring, heap_trimmer=None,
                                 sink=None if wiring.sink is None else _SinkView(wiring.sink, idx, n == 0))
        parts.append((make([live[i] for i in idx], s, group, pw), idx))
    return PartedReducer(parts, wiring)


class _SinkView:
    """One part reducer's window on the engine's gradient sink (offload): its group numbers mapped to the
    optimizer's; the sink's bytes counted by the first part only."""

    def __init__(self, sink: Any, groups: list[int], first: bool) -> None:
        self.sink, self.groups, self.first = sink, groups, first

    def add(self, g: int, lo: int, values: torch.Tensor) -> None:
        self.sink.add(self.groups[g], lo, values)

    def end_micro_step(self) -> None:
        self.sink.end_micro_step()

    def zero(self) -> None:
        self.sink.zero()

    def host_bytes(self) -> int:
        return self.sink.host_bytes() if self.first else 0


class PartedReducer:
    """Several reducers, one per partition axis (dense over dp, each expert set over its edp), behind one
    reducer interface; groups numbered as the optimizer's."""

    @property
    def sink(self) -> Any:
        """Where reduced gradients go under offload (set by ``runtime/build.py``); each part writes through
        a view that numbers its groups as the optimizer does."""
        return self._sink

    @sink.setter
    def sink(self, value: Any) -> None:
        self._sink = value
        for n, (r, idx) in enumerate(self.parts):
            r.sink = None if value is None else _SinkView(value, idx, n == 0)

    def __init__(self, parts: list[tuple[GradReducer, list[int]]], wiring: ReducerWiring | None = None) -> None:
        self._sink = None if wiring is None else wiring.sink
        self.heap_trimmer = None if wiring is None else wiring.heap_trimmer
        self.parts = parts
        self.index = {gi: (r, local) for r, idx in parts for local, gi in enumerate(idx)}
        self.groups = [self.index[gi][0].groups[self.index[gi][1]] for gi in range(len(self.index))]
        # parameter -> (group, index), groups numbered as the optimizer's (the pipeline's tied-weight reduction)
        self.where = {p: (gi, i) for gi, grp in enumerate(self.groups) for i, p in enumerate(grp.params)}

    def _bucket_buffer(self, g: int, b: int) -> torch.Tensor:
        reducer, local = self.index[g]
        return reducer._bucket_buffer(local, b)

    def partition_buffer(self, g: int) -> torch.Tensor:
        reducer, local = self.index[g]
        return reducer.partition_buffer(local)

    def begin_micro_step(self, communicate: bool) -> None:
        for r, _ in self.parts:
            r.begin_micro_step(communicate)

    def end_micro_step(self) -> None:
        for r, _ in self.parts:
            r.end_micro_step()

    def zero(self) -> None:
        for r, _ in self.parts:
            r.zero()

    def grad_bytes(self) -> int:
        return sum(r.grad_bytes() for r, _ in self.parts)

    def remove_hooks(self) -> None:
        for r, _ in self.parts:
            r.remove_hooks()

    # --- unused parameters and failure recovery (each part agrees over its own group) ---------------
    def settle_late(self) -> None:
        for r, _ in self.parts:
            r.settle_late()

    def release_in_flight(self) -> None:
        for r, _ in self.parts:
            r.release_in_flight()

    def reset(self) -> None:
        for r, _ in self.parts:
            r.reset()

    @property
    def ignore_unused_parameters(self) -> bool:
        return all(r.ignore_unused_parameters for r, _ in self.parts)

    @ignore_unused_parameters.setter
    def ignore_unused_parameters(self, value: bool) -> None:
        for r, _ in self.parts:
            r.ignore_unused_parameters = value

    @property
    def names(self) -> dict:
        return self.parts[0][0].names if self.parts else {}

    @names.setter
    def names(self, value: dict) -> None:
        for r, _ in self.parts:
            r.names = value
