"""The gradient reducer's settings and parts, and the one place where the stage picks them.

* stages 0-1: a full-size buffer per group (micro-steps accumulate locally; one reduction per window; stage 1
  reduce-scatters it into this rank's partition);
* stages 2-3: transient bucket buffers reduced on every micro-step and added into the partition (a group of
  one partition keeps a full buffer: it *is* its partition). With ``local_accumulation`` (zerospeed's
  ``zero_local_grad_accumulation``) the first micro-step that does not end a window makes stage 1's full
  buffers, and from then on stage 2 reduces once per window: 2Ψ on the wire per step instead of (gas+1)Ψ,
  for 4Ψ more bytes (fp32) per rank;
* the destination: the device partition, or the offload sink when gradients leave the device;
* the compressor: dense, or top-k with error feedback (``gradient_compression``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .bucket_store import BucketStore
from .grad_compressor import DenseCompressor, TopKCompressor
from .grad_dest import PartitionDest, SinkDest
from .sharded_group import ShardedGroup


@dataclass(frozen=True)
class ReduceSettings:
    stage: int
    dp_size: int
    accum_dtype: torch.dtype
    comm_dtype: torch.dtype
    reduce_scatter: bool = True
    overlap_comm: bool = True
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    topk_ratio: float = 0.0  # > 0: top-k sparsified averaging (comm/sparse.py) instead of the dense collective
    topk_error_feedback: bool = True
    topk_warmup_steps: int = 0  # optimizer steps reduced densely before sparsification starts
    topk_freeze_variance: bool = False  # then Adam's variance frozen (ZeroOptimizer)
    topk_momentum_correction: bool = False  # and each rank's momentum exchanged instead of its gradient (DGC)
    topk_preconditioned_selection: bool = False  # and entries ranked by |x| / sqrt(v)
    # No gradient partition buffer: each bucket's reduced slice goes to the offload sink (offload/grad_sink.py).
    partition_sink: bool = False
    # Stage 2: accumulate micro-steps in full-size buffers and reduce once per accumulation boundary.
    local_accumulation: bool = False
    average: bool = True  # gradient_allreduce_op: "mean" (DeepSpeed's default); False: "sum" over the ranks


@dataclass(frozen=True)
class ShardAxis:
    """The process group an optimizer group is partitioned and reduced over (instead of the data-parallel one)."""

    name: str  # orders the axes the same way on every rank
    group: Any
    size: int


@dataclass(frozen=True)
class ReducerParts:
    store: BucketStore
    dest: PartitionDest | SinkDest
    compressor: DenseCompressor
    keeps_foreign_grads: bool = True  # a gradient from another engine's backward stays in p.grad (not stage 3)
    checks_all_used: bool = False  # ignore_unused_parameters: false (DeepSpeed checks stages 1-2 only)


@dataclass(frozen=True)
class ReducerWiring:
    """The reducer's collaborators, given at construction (``runtime/build_optimizer.py``)."""

    # Where reduced slices go under ``settings.partition_sink`` (``add(g, partition_offset, values)``,
    # ``end_micro_step()``, ``zero()``, ``host_bytes()``): offload/grad_sink.py.
    sink: Any = None
    # Host engines: a HeapTrimmer (accelerator/host_malloc.py) asked at each bucket launch to give back the
    # activations' freed heap.
    heap_trimmer: Any = None
    # DeepSpeed's ``enable_backward_allreduce``: when this returns False (a 1-bit optimizer in its
    # compression phase, or the top-k momentum exchange after its warm-up; stage 0 only) each rank keeps its
    # local gradient.
    allreduce_gate: Callable[[], bool] | None = None
    names: dict[nn.Parameter, str] = field(default_factory=dict)  # parameter names, for messages
    ignore_unused_parameters: bool = True  # zero_optimization.ignore_unused_parameters (stages 1-2)
    parts: ReducerParts | None = None  # None: reducer_parts(groups, settings, sink, ...)
    # Per group, the axis it is reduced over (MoE: an expert set's expert-data-parallel group); None or a None
    # entry: the data-parallel group.
    axes: Sequence[ShardAxis | None] | None = None


def compressor_for(settings: ReduceSettings, groups: Sequence[ShardedGroup] = (),
                   sparse: frozenset[int] = frozenset()) -> DenseCompressor:
    """Dense or top-k; the buckets holding one parameter of ``sparse`` (ids) travel as rows at one partition."""
    rows = {(g, grp.plan.slots[i].bucket): (p.shape[0], p.numel() // p.shape[0]) for g, grp in enumerate(groups)
            for i, p in enumerate(grp.params) if id(p) in sparse and grp.num_partitions == 1 and p.dim() == 2
            and grp.plan.buckets[grp.plan.slots[i].bucket].params == (i,)}
    if settings.topk_ratio > 0:
        return TopKCompressor(settings.topk_ratio, settings.topk_error_feedback, settings.topk_warmup_steps, rows)
    return DenseCompressor(rows)


def reducer_parts(groups: Sequence[ShardedGroup], settings: ReduceSettings, sink: Any = None,
                  compressor: DenseCompressor | None = None, ignore_unused_parameters: bool = True) -> ReducerParts:
    """The store, destination and compressor for ``settings.stage`` (see the module doc)."""
    transient = settings.stage >= 2
    full = [not transient or (g.num_partitions == 1 and not settings.partition_sink) for g in groups]
    store = BucketStore(groups, settings.accum_dtype, full, reduces_every_micro_step=transient,
                        promotes=settings.stage == 2 and settings.local_accumulation, comm_dtype=settings.comm_dtype)
    dest = SinkDest(groups, sink) if sink is not None else PartitionDest(
        groups, settings.accum_dtype, count_released=transient and not settings.partition_sink)
    return ReducerParts(store, dest, compressor_for(settings) if compressor is None else compressor,
                        keeps_foreign_grads=settings.stage < 3,
                        checks_all_used=not ignore_unused_parameters and settings.stage in (1, 2))


def scales(settings: ReduceSettings, size: int) -> tuple[float, float]:
    """(before, after) the sum over ``size`` ranks: DeepSpeed's prescale_gradients / gradient_predivide_factor."""
    f = settings.gradient_predivide_factor
    if not settings.average:  # gradient_allreduce_op: "sum": the plain sum, as DeepSpeed's (no pre/post scaling)
        return 1.0, 1.0
    return (1.0 / size, 1.0) if settings.prescale_gradients else (1.0 / f, f / size)


class GroupAxes:
    """The process group (and its size) each optimizer group is reduced over, and the groups of each axis:
    the data-parallel axis first, then the others by name (the same order on every rank)."""

    def __init__(self, axes: Sequence[ShardAxis | None], dp_group: Any, dp_size: int) -> None:
        self.comm_of = [(dp_group, dp_size) if a is None else (a.group, a.size) for a in axes]
        names = sorted({"" if a is None else a.name for a in axes})
        self.sets = [[g for g, a in enumerate(axes) if ("" if a is None else a.name) == n] for n in names]

    def order(self) -> list[int]:
        return [g for gs in self.sets for g in gs]

    def __iter__(self) -> Iterator[tuple[list[int], Any, int]]:
        for gs in self.sets:
            yield gs, *self.comm_of[gs[0]]
