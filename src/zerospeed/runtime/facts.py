"""Read the facts ``plan_training`` needs from the model and the objects given to ``initialize()``.

Nothing here builds or communicates: it looks at classes and attributes (a PipelineModule? MoE layers?
an mpu with sequence groups? a 1-bit optimizer?) and checks the shape of an ``mpu``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import ZeroSpeedConfig
from .plan import ModelFacts, OptimizerFacts

_MPU_METHODS = ("get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank")


def optimizer_facts(cfg: ZeroSpeedConfig, client: torch.optim.Optimizer | None) -> OptimizerFacts | None:
    """The client optimizer's traits (from its class), else the config section's (from its type name)."""
    if client is not None:
        kernel = True
        if cfg.zero_optimization.offload_optimizer.enabled and cfg.zero_force_ds_cpu_optimizer:
            from ..offload.cpu_adam import kernel_for

            kernel = kernel_for(client) is not None
        return OptimizerFacts(client=True, compresses=bool(getattr(client, "compresses_communication", False)),
                              orthogonalizes=hasattr(client, "shard_orthogonalizer"),
                              deepspeed_name=getattr(client, "deepspeed_name", type(client).__name__),
                              cpu_kernel=kernel, class_name=type(client).__name__)
    if cfg.optimizer is None:
        return None
    name = cfg.optimizer.type.lower()
    from ..optim.factory import ONEBIT_NAMES

    onebit = {n.lower(): n for n in ONEBIT_NAMES}
    ds_name = ""
    if name in onebit:
        from ..optim import onebit as ob

        cls = {"OneBitAdam": ob.OnebitAdam, "ZeroOneAdam": ob.ZeroOneAdam, "OneBitLamb": ob.OnebitLamb}[onebit[name]]
        ds_name = cls.deepspeed_name
    return OptimizerFacts(client=False, compresses=name in onebit, orthogonalizes=name == "muon",
                          deepspeed_name=ds_name, class_name=cfg.optimizer.type)


def built_optimizer_facts(opt: Any) -> OptimizerFacts:
    """The traits of an optimizer object already built (the config's or the client's)."""
    return OptimizerFacts(client=False, compresses=bool(getattr(opt, "compresses_communication", False)),
                          orthogonalizes=hasattr(opt, "shard_orthogonalizer"),
                          deepspeed_name=getattr(opt, "deepspeed_name", type(opt).__name__),
                          class_name=type(opt).__name__)


def check_mpu(model: nn.Module, mpu: Any) -> None:
    """An ``mpu`` must have DeepSpeed's data-parallel accessors; a PipelineModule brings its own grid."""
    from ..parallel.pipeline.module import PipelineModule

    if isinstance(model, PipelineModule):
        if mpu is not None and mpu is not model.mpu():
            raise ValueError("initialize(mpu=...) with a PipelineModule: the module already defines the grid "
                             "(pass topology= to PipelineModule instead)")
        return
    if mpu is None or callable(getattr(mpu, "get_sequence_parallel_world_size", None)):
        return
    for name in _MPU_METHODS:
        if not callable(getattr(mpu, name, None)):
            raise ValueError(f"initialize(mpu=...): the object has no {name}() (expected an mpu such as "
                             "zerospeed.runtime.pipe.topology.PipelineParallelGrid)")


def model_facts(cfg: ZeroSpeedConfig, model: nn.Module, mpu: Any, optimizer: Any, lr_scheduler: Any) -> ModelFacts:
    """Everything the plan needs to know about what was passed to ``initialize()``."""
    from ..parallel.expert.training import moe_layers
    from ..parallel.pipeline.module import PipelineModule
    from ..parallel.tensor.training import tp_requested

    pipelined = isinstance(model, PipelineModule)
    seq = mpu.get_sequence_parallel_world_size() if callable(
        getattr(mpu, "get_sequence_parallel_world_size", None)) else None
    grid = model.mpu() if pipelined else mpu
    layers = moe_layers(model)
    return ModelFacts(
        pipelined=pipelined, moe=bool(layers), autoep_only=bool(layers) and all(m.autoep for m in layers),
        expert_tp=any(m.enable_expert_tensor_parallelism for m in layers),
        tensor_parallel=tp_requested(model, cfg.tensor_parallel), mpu=mpu is not None,
        mpu_model_parallel=getattr(mpu, "get_model_parallel_world_size", lambda: 1)() if mpu is not None else 1,
        mpu_sequence_parallel=seq,
        slice_parallel=getattr(grid, "get_slice_parallel_world_size", lambda: 1)() if grid is not None else 1,
        optimizer=optimizer_facts(cfg, optimizer), client_scheduler=lr_scheduler is not None)
