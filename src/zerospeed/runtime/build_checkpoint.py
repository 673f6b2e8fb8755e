"""The engine's checkpoint parts (``runtime/checkpoint/part.py``), in save order, from what ``initialize()``
built: which parallelism changes who writes what is decided here, once, not in the checkpoint code."""

from __future__ import annotations

from typing import Any

from torch import nn

from .checkpoint.part import CheckpointPart
from .checkpoint.parts import (CompressionPart, CountersPart, DataEfficiencyPart, ExpertsPart, LoaderPart, OffloadPart,
                               PipelineStagePart, SchedulerPart, TensorParallelPart, ZeroGroupsPart)
from .export_model import ExpertExport, ModelExport, ReplicatedExport, TensorParallelExport
from .plan import TrainPlan

PIPELINE_WITH_TP = ("checkpoints of a pipeline with tensor parallelism are not supported yet by zerospeed")


def checkpoint_parts(plan: TrainPlan, model: nn.Module, optimizer: Any, scheduler: Any, loader: Any,
                     data_efficiency: Any, tensor_parallel: Any, parallel_write: bool = False,
                     compression: Any = None) -> tuple[CheckpointPart, ...]:
    parts: list[CheckpointPart] = []
    if optimizer is not None and optimizer.stepper is not None:  # ZeRO-Offload's stepper, ZenFlow
        parts.append(OffloadPart(optimizer.stepper))
    parts.append(ZeroGroupsPart(optimizer))
    if tensor_parallel is not None and not plan.pipelined:
        parts.append(TensorParallelPart(model))
    if plan.pipelined:
        parts.append(PipelineStagePart(model, PIPELINE_WITH_TP if tensor_parallel is not None else "", parallel_write))
    if plan.moe:
        parts.append(ExpertsPart(model))
    parts += [SchedulerPart(scheduler), CountersPart(),
              LoaderPart(loader, hasattr(loader, "state_dict"), hasattr(loader, "load_state_dict")),
              DataEfficiencyPart(data_efficiency)]
    if compression is not None:  # compression_training / MoQ (compression/runtime.py)
        parts.append(CompressionPart(compression))
    return tuple(parts)


def model_export(tensor_parallel: Any, experts_sharded: bool, dp_group: Any, zero3: Any) -> ModelExport:
    """How ``save_16bit_model`` collects the whole model for this layout (``runtime/export_model.py``)."""
    if tensor_parallel is not None:
        return TensorParallelExport(experts=experts_sharded)
    if experts_sharded:
        return ExpertExport(dp_group, zero3)
    return ReplicatedExport(dp_group, zero3)
