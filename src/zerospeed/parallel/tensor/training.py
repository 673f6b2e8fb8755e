"""Tensor parallelism inside the training engine: the grid, the split, and one gradient norm for all of it.

With ``tensor_parallel`` on (``autotp_size`` > 1 or ``tp_model_init``), ``initialize`` lays the world out as
``PipeModelDataParallelTopology(pp=1, tp, dp=world/tp)`` (tensor-parallel peers adjacent), splits the model
over the ``model`` axis and trains it with ZeRO over the ``data`` axis only:

    world 4, tp 2:   rank 0 1 | 2 3        tp groups [0,1] [2,3]   dp groups [0,2] [1,3]

Gradients of every parameter are reduced over its data-parallel group; those of replicated parameters are
already equal across the tensor-parallel group (their inputs and output gradients are), so nothing else is
summed. The global gradient norm sums squares over the data-parallel partitions, then adds the split
parameters' squares over the tensor-parallel group and counts the replicated ones once (``zero/norm_axes.py``,
described by ``runtime/build_optimizer.norm_axes`` from ``split`` and ``tp_group``). The data loader is
built over the data-parallel rank, so every rank of a tensor-parallel group reads the same batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ... import comm
from ...config.tensor_parallel import TensorParallelConfig
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
