"""Bringing the last stage's losses to everyone: mean over micro-batches, over data-parallel replicas, and a
broadcast along the pipeline so ``train_batch`` / ``eval_batch`` return the same value on every stage."""

from __future__ import annotations

from typing import Any

import torch

from ... import comm
from ..topology import PipelineParallelGrid


def _is_last(grid: PipelineParallelGrid) -> bool:
    return grid.get_pipe_parallel_rank() == grid.get_pipe_parallel_world_size() - 1


def _dp_mean_(t: torch.Tensor, grid: PipelineParallelGrid) -> torch.Tensor:
    if grid.get_data_parallel_world_size() > 1:
        comm.all_reduce(t, group=grid.get_data_parallel_group())
        t /= grid.get_data_parallel_world_size()
    return t


def reduce_outputs(outputs: list[Any], reduce: str | None, micro_batches: int, grid: PipelineParallelGrid) -> Any:
    """Last stage: DeepSpeed's ``reduce_output``: None keeps the list; 'avg' averages micro-batches and replicas."""
    if reduce is None:
        return outputs
    if reduce.lower() != "avg":
        raise NotImplementedError(f"reduction type {reduce} not supported.")
    if torch.is_tensor(outputs[0]):
        return _dp_mean_((sum(outputs) / micro_batches).clone(), grid)
    return [_dp_mean_(sum(o[i] for o in outputs) / micro_batches, grid) for i in range(len(outputs[0]))]


def broadcast_from_last(value: Any, grid: PipelineParallelGrid) -> torch.Tensor:
    """The last stage's scalar, on every stage of this pipeline."""
    src = grid.stage_to_global(grid.get_pipe_parallel_world_size() - 1)
    dev = comm.device_for_backend(grid.get_pipe_parallel_group())
    last = _is_last(grid)
    t = (value.detach().float().reshape(-1)[:1].clone().to(dev) if last
         else torch.zeros(1, dtype=torch.float32, device=dev))
    comm.broadcast(t, src=src, group=grid.get_pipe_parallel_group())
    return t.reshape(()) if not last or value.dim() == 0 else t


def mean_loss_everywhere(mean: torch.Tensor | None, grid: PipelineParallelGrid, device: torch.device) -> torch.Tensor:
    """``mean`` (the last stage's mean over micro-batches), averaged over replicas and sent to every stage."""
    piped = grid.get_pipe_parallel_world_size() > 1
    dev = comm.device_for_backend(grid.get_pipe_parallel_group()) if piped else device
    if _is_last(grid):
        assert mean is not None, "the last stage computed no loss"
        loss = _dp_mean_(mean.reshape(1).to(dev).clone(), grid)
    else:
        loss = torch.zeros(1, dtype=torch.float32, device=dev)
    if piped:
        comm.broadcast(loss, src=grid.stage_to_global(grid.get_pipe_parallel_world_size() - 1),
                       group=grid.get_pipe_parallel_group())
    return loss.reshape(())
