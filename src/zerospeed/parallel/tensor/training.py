"""Tensor parallelism inside the training engine: the grid, the split, and one gradient norm for all of it.

With ``tensor_parallel`` on (``autotp_size`` > 1 or ``tp_model_init``), ``initialize`` lays the world out as
``PipeModelDataParallelTopology(pp=1, tp, dp=world/tp)`` (tensor-parallel peers adjacent), splits the model
over the ``model`` axis and trains it with ZeRO over the ``data`` axis only:

    world 4, tp 2:   rank 0 1 | 2 3        tp groups [0,1] [2,3]   dp groups [0,2] [1,3]

Gradients of every parameter are reduced over its data-parallel group; those of replicated parameters are
already equal across the tensor-parallel group (their inputs and output gradients are), so nothing else is
summed. The global gradient norm sums squares over the data-parallel partitions, then adds the split
parameters' squares over the tensor-parallel group and counts the replicated ones once. The data loader is
built over the data-parallel rank, so every rank of a tensor-parallel group reads the same batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ... import comm
from ...config.tensor_parallel import TensorParallelConfig
from ...zero import ZeroOptimizer
from .model_init import REQUEST_ATTR, TensorParallelModel, autotp_shard, merge_request


def tp_requested(model: nn.Module, section: TensorParallelConfig) -> bool:
    return getattr(model, REQUEST_ATTR, None) is not None or section.size > 1


class TensorParallelTraining:
    """The grid and the split of one engine's model (built on every rank; group creation is collective)."""

    def __init__(self, model: nn.Module, section: TensorParallelConfig, grid: Any = None) -> None:
        from ..topology import PipelineParallelGrid, PipeModelDataParallelTopology

        section, dtype, tp_group = merge_request(model, section)
        size = section.size
        world = comm.get_world_size()
        tp_group = tp_group if tp_group is not None else section.tp.tp_group
        if tp_group is not None or section.tp.mpu is not None:
            raise ValueError("a given tensor-parallel group (tp_model_init(tp_group=...), tensor_parallel.tp.tp_group "
                             "or .mpu) is not supported yet by zerospeed: initialize builds the groups from the topology")
        if grid is None:
            if world % size:
                raise ValueError(f"tensor_parallel size {size} does not divide the world size {world}")
            grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=size, num_dp=world // size))
        elif grid.get_slice_parallel_world_size() != size:
            raise ValueError(f"tensor_parallel size {size} but the topology's model axis has "
                             f"{grid.get_slice_parallel_world_size()} ranks")
        self.grid = grid
        self.tp_group = grid.get_slice_parallel_group()
        self.model: TensorParallelModel = autotp_shard(model, self.tp_group, section, dtype)
        self.split = self.model.split_params(model)

    def wrap_optimizer(self, opt: ZeroOptimizer) -> "TensorParallelZeroOptimizer":
        return TensorParallelZeroOptimizer.wrap(opt, self.tp_group, self.split)


def split_and_replicated_sq(opt: ZeroOptimizer, grads: list[torch.Tensor], split: frozenset[int],
                            skip: frozenset[int] = frozenset()) -> torch.Tensor:
    """``[sum of squares over split params, over replicated params]`` of this rank's gradient partitions
    (``skip``: tied copies another pipeline stage counts)."""
    out = torch.zeros(2, dtype=torch.float32, device=grads[0].device if grads else None)
    for grp, g in zip(opt.groups, grads):  # each slot on its own: "total - split" would round differently per rank
        for i, p in enumerate(grp.params):
            if id(p) not in skip:
                out[0 if id(p) in split else 1] += torch.linalg.vector_norm(grp.slot_view(g, i),
                                                                            dtype=torch.float32).square()
    return out


class TensorParallelZeroOptimizer(ZeroOptimizer):
    """The ZeRO optimizer over the data-parallel group, with norm and overflow over the tensor-parallel group
    (and, wrapping a pipeline's optimizer, over the pipeline stages: ``pipe_group``, tied copies counted once)."""

    tp_group: Any = None
    split: frozenset[int] = frozenset()
    pipe_group: Any = None
    replicated: frozenset[int] = frozenset()

    @classmethod
    def wrap(cls, opt: ZeroOptimizer, tp_group: Any, split: set[int]) -> "TensorParallelZeroOptimizer":
        out = cls.__new__(cls)
        out.__dict__.update(opt.__dict__)
        out.tp_group = tp_group
        out.split = frozenset(split)
        return out

    def _has_overflow(self, grads: list[torch.Tensor]) -> bool:
        local = super()._has_overflow(grads)
        if self.pipe_group is not None:
            local = comm.all_reduce_max_flag(local, group=self.pipe_group)
        return comm.all_reduce_max_flag(local, group=self.tp_group)

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        if self._sink is not None and not self._sink.resident:
            raise ValueError("tensor parallelism with NVMe optimizer offload of gradients is not supported yet by "
                             "zerospeed")
        sq = split_and_replicated_sq(self, grads, self.split, self.replicated).to(comm.device_for_backend(self.dp_group))
        if self.partitioned:
            comm.all_reduce(sq, group=self.dp_group)
        elif comm.get_world_size(self.dp_group) > 1:
            comm.all_reduce_max_flag(False, group=self.dp_group)  # the commit point, as in ZeroOptimizer
        if self.pipe_group is not None:
            comm.all_reduce(sq, group=self.pipe_group)
        split_sq = sq[:1].clone()
        comm.all_reduce(split_sq, group=self.tp_group)
        return math.sqrt(max(float(split_sq[0] + sq[1]), 0.0))
