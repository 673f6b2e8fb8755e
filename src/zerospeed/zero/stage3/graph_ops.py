"""ZeRO-3's gather and gradient hand-off as graph operations (DeepCompile), so the compiler traces through them.

Custom operators registered with ``torch.library`` (public API), each with a fake implementation (the
shapes the compiler traces with), the gather with an autograd formula:

* ``zerospeed::z3_gather(anchor, graph, unit) -> Tensor[]``: unit ``unit``'s parameters, whole. The real
  implementation runs the parameter store's gather (``ensure_gathered``: the same collectives, lockstep
  checks, qwZ/hpZ and offload reads as eager stage 3) and hands each gathered buffer to the graph, the
  parameter itself going straight back to ``SHARDED``: the graph owns the full value, and the value dies
  when the graph stops referencing it. (A value another holder keeps gathered, e.g. ``GatheredParameters``,
  is copied instead.) ``anchor`` is a one-element tensor that requires grad: it makes autograd call the
  formula; the parameters themselves are not inputs of the op.
* ``zerospeed::z3_reduce(grads, graph, unit) -> Tensor``: the gather's backward. It hands each full
  gradient to the stage-3 reducer (``take_grad``: bucket, reduce-scatter, the same path as eager
  stage 3's gradient hooks) and returns the anchor's gradient (one fp32 zero: not empty, since inductor
  drops ops whose outputs have no elements).
* ``zerospeed::z3_prefetch(anchor, graph, units) -> Tensor``: starts the all-gather of every unit in ``units``
  asynchronously, as one collective (and one lockstep check) where their shards share a dtype, device and
  group, as eager stage 3's fetcher launches its window; returns a token (one element). The prefetch pass
  (``graph_passes.py``) turns each of those units' ``z3_gather`` into ``z3_gather_prefetched(anchor, graph,
  unit, token)``, which waits for it (the token orders the two).

* ``zerospeed::z3_schedule(anchor, graph, ops, digest) -> Tensor``: the first op of every compiled graph that
  gathers (the schedule pass, ``graph_passes.check_schedule``): one lockstep exchange naming the graph's
  ``ops`` gathers and prefetches and a ``digest`` of their sequence, then those ops run without an exchange
  each (``lockstep.Lockstep.check_schedule``). Its one-element result is the anchor of every gather and
  prefetch of the graph, so no compiler moves one before it.

``graph`` is the handle of a :class:`GraphUnits` (one per engine; the op arguments must be plain values).
The fake gather reads only the static shapes of the handle's units.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from .fetcher import Unit
from .lockstep import Lockstep
from .param_store import ParamShard, ensure_gathered, start_gather

GradSink = Callable[[nn.Parameter, torch.Tensor], None]

_HANDLES = itertools.count()
_GRAPHS: weakref.WeakValueDictionary[int, GraphUnits] = weakref.WeakValueDictionary()


class GraphUnits:
    """One engine's units as the graph ops see them, the reducer's gradient sink, and counts for checks."""

    def __init__(self, units: Sequence[Unit], sink: GradSink) -> None:
        # each shard in one unit only, its first in the recorded order (a tied weight is owned by two modules)
        seen: set[int] = set()
        self.units: list[list[ParamShard]] = []
        for u in units:
            mine = [s for s in u.shards if id(s) not in seen]
            seen.update(id(s) for s in mine)
            if mine:
                self.units.append(mine)
        self.sink = sink
        self.handle = next(_HANDLES)
        self.gathers = 0  # z3_gather calls that ran (forward and backward recomputation)
        self.prefetches = 0  # units z3_prefetch started
        self.prefetch_calls = 0  # z3_prefetch calls that ran (each starts one or more units)
        self.reduces = 0  # z3_reduce calls that ran
        self.schedule_checks = 0  # z3_schedule calls that ran (one lockstep exchange each, at world > 1)
        self.covered = 0  # gathers/prefetches left in the running graph whose schedule every rank checked
        self.covered_ops = 0  # such ops that ran (no exchange of their own)
        # offload_activation (graph_offload.py): activations copied to the host, read back, host bytes held now
        self.act_offloads = 0
        self.act_reloads = 0
        self.act_host_bytes = 0
        self.log: list[tuple[str, int]] | None = None  # (op, unit) per call when debug_log is on
        # compile.sync_{before,after}_{allgather,reduce}: the accelerator is synchronised at those points
        self.sync_points: frozenset[str] = frozenset()
        self.synchronize: Callable[[], None] = lambda: None
        _GRAPHS[self.handle] = self

    def sync(self, point: str) -> None:
        if point in self.sync_points:
            self.synchronize()

    @property
    def lockstep(self) -> Lockstep | None:
        return self.units[0][0].lockstep if self.units else None

    @contextmanager
    def covering(self) -> Iterator[None]:
        """Around one gather or prefetch op: under the running graph's checked schedule (if any is left), its
        collectives make no lockstep exchange of their own."""
        lock = self.lockstep
        if self.covered <= 0 or lock is None:
            yield
            return
        self.covered -= 1
        self.covered_ops += 1
        lock.covered = True
        try:
            yield
        finally:
            lock.covered = False

    def shapes(self, unit: int) -> list[tuple[torch.Size, torch.dtype]]:
        return [(s.shape, s.value_dtype) for s in self.units[unit]]

    def note(self, op: str, unit: int) -> None:
        if self.log is not None:
            self.log.append((op, unit))


def graph_units(handle: int) -> GraphUnits:
    found = _GRAPHS.get(handle)
    if found is None:
        raise RuntimeError(f"DeepCompile graph {handle}: its engine no longer exists (a compiled graph outlived it)")
    return found


def _take_full(s: ParamShard) -> torch.Tensor:
    """The gathered value of ``s`` for the graph: its buffer, handed off, and ``s`` released (else a copy)."""
    full = s.param.data
    if s.holders or s.persistent:
        return full.clone()
    s.hand_off_full()
    s.release()
    return full


@torch.library.custom_op("zerospeed::z3_prefetch", mutates_args=())
def z3_prefetch(anchor: torch.Tensor, graph: int, units: list[int]) -> torch.Tensor:
    g = graph_units(graph)
    g.prefetch_calls += 1
    g.prefetches += len(units)
    for unit in units:
        g.note("prefetch", unit)
    g.sync("before_allgather")
    # the shards' pending gathers, launched together; each unit's z3_gather_prefetched waits
    with g.covering():
        start_gather([s for unit in units for s in g.units[unit]], async_op=True, quantize=True)
    return torch.zeros(1, device=anchor.device)  # one element: inductor drops empty outputs


@z3_prefetch.register_fake
def _z3_prefetch_fake(anchor: torch.Tensor, graph: int, units: list[int]) -> torch.Tensor:
    return torch.empty(1, device=anchor.device)


@torch.library.custom_op("zerospeed::z3_schedule", mutates_args=())
def z3_schedule(anchor: torch.Tensor, graph: int, ops: int, digest: int) -> torch.Tensor:
    g = graph_units(graph)
    lock = g.lockstep
    checked = lock.check_schedule(ops, digest) if lock is not None else False
    g.schedule_checks += int(checked)
    g.covered = ops if checked else 0
    return torch.zeros(1, device=anchor.device)


@z3_schedule.register_fake
def _z3_schedule_fake(anchor: torch.Tensor, graph: int, ops: int, digest: int) -> torch.Tensor:
    return torch.empty(1, device=anchor.device)


def _gather(anchor: torch.Tensor, graph: int, unit: int, prefetched: bool) -> list[torch.Tensor]:
    g = graph_units(graph)
    g.gathers += 1
    g.note("gather", unit)
    shards = g.units[unit]
    if not prefetched:
        g.sync("before_allgather")
    with g.covering():
        ensure_gathered(shards, quantize=True)  # waits for a prefetch in flight, gathers the rest now
    g.sync("after_allgather")
    return [_take_full(s) for s in shards]


def _gather_fake(anchor: torch.Tensor, graph: int, unit: int) -> list[torch.Tensor]:
    return [anchor.new_empty(shape, dtype=dtype) for shape, dtype in graph_units(graph).shapes(unit)]


@torch.library.custom_op("zerospeed::z3_gather", mutates_args=())
def z3_gather(anchor: torch.Tensor, graph: int, unit: int) -> list[torch.Tensor]:
    return _gather(anchor, graph, unit, prefetched=False)


@z3_gather.register_fake
def _z3_gather_fake(anchor: torch.Tensor, graph: int, unit: int) -> list[torch.Tensor]:
    return _gather_fake(anchor, graph, unit)


@torch.library.custom_op("zerospeed::z3_gather_prefetched", mutates_args=())
def z3_gather_prefetched(anchor: torch.Tensor, graph: int, unit: int, token: torch.Tensor) -> list[torch.Tensor]:
    """``z3_gather`` after its ``z3_prefetch`` (``token``): only in graphs the passes rewrote (no autograd)."""
    return _gather(anchor, graph, unit, prefetched=True)


@z3_gather_prefetched.register_fake
def _z3_gather_prefetched_fake(anchor: torch.Tensor, graph: int, unit: int, token: torch.Tensor) -> list[torch.Tensor]:
    return _gather_fake(anchor, graph, unit)


@torch.library.custom_op("zerospeed::z3_reduce", mutates_args=())
def z3_reduce(grads: list[torch.Tensor | None], graph: int, unit: int) -> torch.Tensor:
    g = graph_units(graph)
    g.reduces += 1
    g.note("reduce", unit)
    g.sync("before_reduce")
    for s, grad in zip(g.units[unit], grads):
        if grad is not None and s.param.requires_grad:
            g.sink(s.param, grad)
    g.sync("after_reduce")
    return torch.zeros(1, device=g.units[unit][0].device)


@z3_reduce.register_fake
def _z3_reduce_fake(grads: list[torch.Tensor | None], graph: int, unit: int) -> torch.Tensor:
    return torch.empty(1, device=graph_units(graph).units[unit][0].device)


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...], output: object) -> None:
    ctx.graph, ctx.unit = inputs[1], inputs[2]  # type: ignore[attr-defined]
    ctx.set_materialize_grads(False)  # an unused parameter gets no gradient, as in eager


def _backward(ctx: torch.autograd.function.FunctionCtx, grads: Sequence[torch.Tensor | None]) -> tuple[object, ...]:
    return torch.ops.zerospeed.z3_reduce(list(grads), ctx.graph, ctx.unit), None, None  # type: ignore[attr-defined]


z3_gather.register_autograd(_backward, setup_context=_setup)

__all__ = ["GraphUnits", "graph_units", "z3_gather", "z3_gather_prefetched", "z3_prefetch", "z3_reduce", "z3_schedule"]
