"""DeepCompile's ZeRO-3 graph passes: where the gathers and gradient reductions go in a compiled graph.

They rewrite a ``torch.fx.Graph`` (the forward and the backward graph that AOTAutograd produces, or
inductor's post-grad graph) holding the ops of ``graph_ops.py``, and change nothing but the order of
nodes and the prefetch tokens:

* :func:`sink_gathers`: each ``z3_gather`` (with the ``getitem`` nodes that unpack it) moves to just
  before the first node that uses one of its values. Traced, every gather sits at the top of the forward;
  sunk, a unit is whole only from its first use, and the compiled code (FX's generated Python, inductor's
  buffers) frees each value after its last use: release after last use.
* :func:`prefetch`: the all-gather of gather ``k``'s unit starts asynchronously just before the earliest gather
  ``j < k`` such that units ``j+1 .. k`` hold at most ``window`` elements (``stage3_prefetch_bucket_size``), and
  at least one gather ahead. Every unit that starts before the same gather ``j`` goes into one ``z3_prefetch``
  (one collective: the first window of a pass is one launch, not one per unit, as eager's fetcher launches it);
  each of their gathers becomes ``z3_gather_prefetched``, taking that prefetch's token as input, so no compiler
  may reorder the two. A planned schedule: every rank compiles the same graph, so every rank issues the same
  collectives in the same order.
* :func:`reduce_early`: each ``z3_reduce`` of a unit's gradients is split into one ``z3_reduce`` per gradient,
  placed just after the node that produces it: a gradient goes to its reduce-scatter bucket as soon as it is
  final, as eager stage 3's per-parameter hooks hand it, not when the unit's last gradient is (a unit also
  holds the persistent parameters before its module, ``runtime/deepcompile.with_persistent``, whose gradients
  come after the module's own). The parts' one-element results are summed into the anchor's gradient, so
  every part has a user and no compiler drops it.

* :func:`check_schedule`: one ``z3_schedule`` before the graph's first gather or prefetch, carrying their
  number and a digest of their sequence; every gather and prefetch takes its result as anchor (so it runs
  first). The ranks then make one lockstep exchange per graph instead of one per gather.

Selective gather (keeping some units gathered from forward to backward) is decided before partitioning,
by the checkpoint policy (``graph_forward.py``); :func:`selective_units` plans which.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence

import torch
from torch import fx

from . import graph_ops  # noqa: F401  (registers the ops named below)

GATHER = torch.ops.zerospeed.z3_gather.default
PREFETCH = torch.ops.zerospeed.z3_prefetch.default
PREFETCHED = torch.ops.zerospeed.z3_gather_prefetched.default
REDUCE = torch.ops.zerospeed.z3_reduce.default
SCHEDULE = torch.ops.zerospeed.z3_schedule.default


def _calls(graph: fx.Graph, target: object) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def _index(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def sink_gathers(graph: fx.Graph) -> int:
    """Move every gather to just before its first use; returns how many moved."""
    moved = 0
    for gather in _calls(graph, GATHER):
        order = _index(graph)
        unpack = sorted(gather.users, key=order.__getitem__)
        uses = [u for g in unpack for u in g.users] if all(u.target is operator.getitem for u in unpack) else unpack
        if not uses:
            continue
        first = min(uses, key=order.__getitem__)
        if order[first] <= order[gather] + len(unpack) + 1:
            continue
        first.prepend(gather)
        for g in unpack:
            first.prepend(g)
        moved += 1
    return moved


def prefetch(graph: fx.Graph, numel_of: Sequence[int], window: int) -> int:
    """Start each gather's unit ahead (see the module docstring); returns how many gathers were prefetched.
    ``numel_of[unit]``: the elements of each unit; ``window`` <= 0: no prefetch."""
    if window <= 0:
        return 0
    gathers = _calls(graph, GATHER)
    starts: dict[int, list[fx.Node]] = {}  # index j of the gather each launch goes before -> the gathers it serves
    for k in range(1, len(gathers)):
        unit = gathers[k].args[2]
        j, ahead = k - 1, int(numel_of[unit])  # type: ignore[index]
        while j > 0 and ahead + int(numel_of[gathers[j].args[2]]) <= window:  # type: ignore[index]
            ahead += int(numel_of[gathers[j].args[2]])  # type: ignore[index]
            j -= 1
        if int(numel_of[unit]) > window:  # type: ignore[index]
            continue  # larger than the window on its own: gathered when needed
        starts.setdefault(j, []).append(gathers[k])
    for j, served in starts.items():
        first = served[0]
        with graph.inserting_before(gathers[j]):
            token = graph.call_function(PREFETCH, (first.args[0], first.args[1], [g.args[2] for g in served]))
        anchor = first.args[0]
        if isinstance(anchor, fx.Node) and "val" in anchor.meta:  # inductor lowers from the fake values
            token.meta["val"] = anchor.meta["val"].new_empty(1)
        for gather in served:
            gather.target = PREFETCHED
            gather.args = (*gather.args[:3], token)
            gather.meta.pop("eager_input_vals", None)  # inductor's record of the old op's inputs (3, not 4)
    return sum(map(len, starts.values()))


def reduce_early(graph: fx.Graph) -> int:
    """Hand every gradient to its reduction just after the node that produces it (one ``z3_reduce`` per
    gradient); returns how many reductions moved or were made."""
    moved = 0
    for red in _calls(graph, REDUCE):
        grads = list(red.args[0])  # type: ignore[arg-type]
        producers = [g for g in grads if isinstance(g, fx.Node)]
        if not producers:
            continue
        if len(producers) == 1:
            if _index(graph)[red] != _index(graph)[producers[0]] + 1:
                producers[0].append(red)
                moved += 1
            continue
        total: fx.Node | None = None
        for j, g in enumerate(grads):
            if not isinstance(g, fx.Node):
                continue
            with graph.inserting_after(g):
                part = graph.call_function(REDUCE, ([g if k == j else None for k in range(len(grads))], *red.args[1:]),
                                           dict(red.kwargs))
            part.meta = dict(red.meta)
            moved += 1
            if total is None:
                total = part
                continue
            later, earlier = (part, total) if _index(graph)[part] > _index(graph)[total] else (total, part)
            with graph.inserting_after(later):
                total = graph.call_function(torch.ops.aten.add.Tensor, (earlier, later))
            total.meta = dict(red.meta)
        assert total is not None
        red.replace_all_uses_with(total)
        graph.erase_node(red)
    return moved


def schedule_digest(ops: Sequence[fx.Node]) -> int:
    """A digest (62 bits) of a graph's gathers and prefetches in order: each op's name and unit(s)."""
    text = repr([(str(n.target), n.args[2]) for n in ops]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def check_schedule(graph: fx.Graph) -> int:
    """Put one ``z3_schedule`` before the graph's first gather or prefetch and make it their anchor; returns
    the number of ops it covers (0: the graph gathers nothing, or already has one)."""
    if _calls(graph, SCHEDULE):
        return 0
    ops = [n for n in graph.nodes if n.op == "call_function" and n.target in (GATHER, PREFETCH, PREFETCHED)]
    if not ops:
        return 0
    first = ops[0]
    anchor = first.args[0]
    with graph.inserting_before(first):
        sched = graph.call_function(SCHEDULE, (anchor, first.args[1], len(ops), schedule_digest(ops)))
    if isinstance(anchor, fx.Node) and "val" in anchor.meta:  # inductor lowers from the fake values
        sched.meta["val"] = anchor.meta["val"].new_empty(1)
    for n in ops:
        n.args = (sched, *n.args[1:])
    return len(ops)


def selective_units(numel_of: Sequence[int], budget: int) -> set[int]:
    """Units kept gathered from forward to backward: the last ones of the forward (the first the backward
    needs), as many as fit in ``budget`` elements (eager stage 3's reuse rule, planned once)."""
    keep: set[int] = set()
    used = 0
    for unit in range(len(numel_of) - 1, -1, -1):
        if used + numel_of[unit] > budget:
            break
        used += numel_of[unit]
        keep.add(unit)
    return keep


def run_passes(graph: fx.Graph, names: Sequence[str], numel_of: Sequence[int], window: int) -> dict[str, int]:
    """The named passes in their fixed order (sink, prefetch, reduce); returns what each changed."""
    done: dict[str, int] = {}
    if "prefetch" in names or "release" in names:
        done["sink"] = sink_gathers(graph)
    if "prefetch" in names:
        done["prefetch"] = prefetch(graph, numel_of, window)
    if "reduce" in names:
        done["reduce"] = reduce_early(graph)
    done["schedule"] = check_schedule(graph)  # last: it covers the gathers and prefetches as placed
    graph.lint()
    return done


__all__ = ["check_schedule", "prefetch", "reduce_early", "run_passes", "schedule_digest", "selective_units",
           "sink_gathers"]
