"""Assembly of the process grids: sequence, pipeline/mpu, tensor and expert parallelism (see runtime/plan.py).

Each function builds what the plan decided; the refusals of unsupported combinations live in the plan's table.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import comm
from ..config import ZeroSpeedConfig
from .facts import check_mpu
from .plan import TrainPlan


def parallel_grid(model: nn.Module, mpu: Any) -> Any:
    """The process grid when the model is a PipelineModule (its own grid) or an ``mpu`` is given, else None."""
    from ..parallel.pipeline.module import PipelineModule

    check_mpu(model, mpu)
    if isinstance(model, PipelineModule):
        return model.mpu()
    return mpu


def sequence_grid(plan: TrainPlan, mpu: Any) -> Any:
    """The (data, sequence) grid when ``sequence_parallel_size`` > 1 or ``mpu`` is a sequence-parallel grid
    (``parallel/sequence/groups.py``), else None."""
    if not plan.sequence:
        return None
    if plan.sequence_from_mpu:
        return mpu
    from ..parallel.sequence.groups import SequenceParallelGrid

    return SequenceParallelGrid(plan.sequence_parallel)


def tensor_parallel(plan: TrainPlan, cfg: ZeroSpeedConfig, model: nn.Module, grid: Any) -> Any:
    """AutoTP (``tensor_parallel`` section or ``tp_model_init``): split the model over the grid's model axis."""
    if not plan.tensor_parallel:
        return None
    from ..parallel.tensor.training import TensorParallelTraining

    return TensorParallelTraining(model, cfg.tensor_parallel, grid)


def moe_training(plan: TrainPlan, cfg: ZeroSpeedConfig, model: nn.Module, dp_group: comm.Group | None,
                 grid: Any = None, tp: Any = None) -> Any:
    """Expert groups and gradient routing when the model holds MoE layers (None otherwise); with AutoTP
    (``plan.folding``) the AutoEP layers fold over its tensor group."""
    if not plan.moe:
        return None
    from ..parallel.expert.training import MoETraining

    return MoETraining(model, dp_group, cfg.zero_stage, cfg.zero_optimization.offload_optimizer.device,
                       cfg.use_data_before_expert_parallelism, grid, tp.tp_group if plan.folding else None)


class Grids:
    """The groups of one engine: ZeRO's (``dp_group``), the data replicas' and the parallelism runtimes."""

    def __init__(self, plan: TrainPlan, early: ZeroSpeedConfig, model: nn.Module, mpu: Any) -> None:
        from ..config import load_config

        self.seq = sequence_grid(plan, mpu)
        grid = parallel_grid(model, mpu) if self.seq is None else None
        self.tp = tensor_parallel(plan, early, model, grid)
        self.grid = self.tp.grid if self.tp is not None and grid is None else grid
        # The engine's own connections (docs/recovery.md): dropped and rebuilt after a failed step, leaving the
        # world group the user's code talks on untouched. A pipeline or a user's mpu brings its grid's groups.
        # Under sequence parallelism ZeRO partitions and reduces over every rank (data x sequence, DeepSpeed's
        # seq_data_parallel_group): the average over it is the sum over a sequence group of its ranks' losses
        # averaged over the group, so a per-rank mean loss gives the unsharded gradient.
        if self.grid is None and self.seq is None:  # the batch rules fail on every rank before a new group connects
            load_config(early, comm.get_world_size())  # (a rank leaving while its peer connects breaks the peer)
        g = self.grid
        self.dp_group = comm.RecoverableGroup(early.comms_timeout_s) if g is None else g.get_data_parallel_group()
        self.dp_size, self.dp_rank = comm.get_world_size(self.dp_group), comm.get_rank(self.dp_group)
        # Samples: sequence peers share theirs, so batch sizes and the data loader count data-parallel replicas.
        s = self.seq
        self.data_size, self.data_rank = ((self.dp_size, self.dp_rank) if s is None else
                                          (s.get_data_parallel_world_size(), s.get_data_parallel_rank()))
        self.data_group = self.dp_group if s is None else s.get_data_parallel_group()
        if g is not None and early.comms_timeout_s is not None:
            comm.set_timeout(early.comms_timeout_s, self.dp_group)
        self.moe = moe_training(plan, early, model, self.dp_group, self.grid, self.tp)
