"""initialize(): join the group -> plan (runtime/plan.py) -> place the model -> build the optimizer stack ->
``Engine``. The one place that wires the parts together; each assembly step is a small builder module
(``build_parallel``, ``build_model``, ``build_optimizer``, ``build_data``) and every refusal of an
unsupported combination is a row of the plan's table."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import checkpointing, comm
from ..accelerator import get_accelerator
from ..accelerator.host_malloc import HeapTrimmer, limit_heap_retention
from ..profiling.flops_profiler.report import module_params
from ..compression.runtime import compression_runtime
from ..config import ConfigError, ZeroSpeedConfig, load_config
from ..config.hints import log_accepted_hints
from ..precision import AutocastRegion, make_policy
from .arguments import InitializeArgumentError
from .build_checkpoint import checkpoint_parts, model_export
from .build_data import data_efficiency, training_loader
from .build_model import fp8_linears, optimizer_groups, place_model
from .build_optimizer import build_scheduler, optimizer_stack
from .build_parallel import Grids
from .deepspeed_rules import check_data_parallel_size, prefer_client_objects
from .engine import Engine
from .facts import model_facts
from .hybrid_engine import hybrid_engine
from .graphs import check_graph_harvesting
from .lockstep import check_same_model
from .log import set_log_level_from_string
from .parts import EngineParts
from .plan import TrainPlan, plan_training
from .state_dump import engine_state


def activation_checkpointing(cfg: ZeroSpeedConfig) -> checkpointing.ActivationCheckpointing:
    """The engine's own activation checkpointing when its config has the section; otherwise the process
    default, which DeepSpeed scripts configure through ``deepspeed.checkpointing.configure``."""
    if "activation_checkpointing" in cfg.model_fields_set:
        return checkpointing.ActivationCheckpointing()
    return checkpointing.current()


def _config_from(args: Any, config: Any, config_params: Any) -> Any:
    """DeepSpeed's rules: ``config`` (or ``config_params``) or ``args.deepspeed_config``, never both."""
    if config is None and config_params is not None:
        config = config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "zerospeed_config", None)
        if getattr(args, "deepscale_config", None) is not None:  # DeepSpeed's deprecated name
            if from_args is not None:
                raise ConfigError("", "Not sure how to proceed, we were given both a deepscale_config and "
                                      "deepspeed_config (as in DeepSpeed): keep args.deepspeed_config")
            warnings.warn("args.deepscale_config is deprecated, please use args.deepspeed_config")
            from_args = args.deepscale_config
    if from_args is not None:
        if config is not None:
            raise ConfigError("", "Not sure how to proceed, we were given deepspeed configs in the deepspeed "
                                  "arguments and deepspeed.initialize() function call (as in DeepSpeed): pass "
                                  "args.deepspeed_config or config=, not both")
        config = from_args
    if config is None:
        raise ConfigError("", "no config: pass config=<path or dict>, or args with .deepspeed_config")
    return config


def _join(dist_init_required: bool | None, distributed_port: int | None, cfg_timeout: float | None) -> None:
    """Join the process group as DeepSpeed does: create it unless the caller said it exists."""
    if comm.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("initialize(dist_init_required=False) but no process group exists: call "
                           "zerospeed.init_distributed() first, or leave dist_init_required unset")
    if distributed_port is not None:
        import os

        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    comm.init_distributed(timeout=cfg_timeout)


def _joined(dist_init_required: bool | None, distributed_port: int | None, cfg: ZeroSpeedConfig) -> None:
    _join(dist_init_required, distributed_port, cfg.comms_timeout_s)
    if cfg.comms_timeout_s is not None:
        comm.set_timeout(cfg.comms_timeout_s, comm.world_group())


def _model_and_optimizer(model: nn.Module | None, optimizer: Any, model_parameters: Any,
                         kwargs: dict[str, Any]) -> tuple[nn.Module, Any]:
    if model is None:
        raise InitializeArgumentError("initialize() needs model=<torch.nn.Module>")
    if kwargs:
        raise TypeError(f"initialize() got unexpected arguments: {sorted(kwargs)}")
    if optimizer is not None and callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters() if model_parameters is None else model_parameters)
    return model, optimizer


def _engine(plan: TrainPlan, cfg: ZeroSpeedConfig, model: nn.Module, grids: Grids, zero_opt: Any, scheduler: Any,
            loader: Any, stage3: Any, fp8_modules: list[str], device: torch.device, compute: torch.dtype,
            trimmer: Any, autocast: Any, compression: Any = None) -> Engine:
    batch = cfg.batch(grids.data_size)
    lg = cfg.comms_logger  # the engine's own counts; the process default prints (verbose) and serves comm's API
    comm.COMMS_LOGGER.configure(lg.enabled, lg.verbose, lg.prof_all, lg.prof_ops, lg.debug)
    comms = comm.CommsLogger()
    comms.configure(lg.enabled, False, lg.prof_all, lg.prof_ops, lg.debug)
    from ..parallel.expert.training import moe_layers

    tp = grids.tp  # every rank writes under AutoTP (tp shards x dp partitions) and in a pipeline (every stage)
    experts_sharded = grids.moe is not None and any(m.ep_size > 1 for m in moe_layers(model))
    de = data_efficiency(plan, cfg, batch.train_batch_size)
    parts = EngineParts(checkpoint_group=None if tp is None and not plan.pipelined else comm.world_group(),
                        checkpoint_parts=checkpoint_parts(plan, model, zero_opt, scheduler, loader, de, tp,
                                                         cfg.checkpoint.parallel_write.pipeline_stage, compression),
                        activation_checkpointing=activation_checkpointing(cfg),
                        model_export=model_export(grids.tp, experts_sharded, grids.dp_group, stage3),
                        mp_world_size=1 if tp is None else tp.model.size, optimizer=zero_opt, lr_scheduler=scheduler, training_dataloader=loader, zero3=stage3,
                        data_efficiency=de, tensor_parallel=grids.tp,
                        sequence_grid=grids.seq, fp8_modules=fp8_modules, heap_trimmer=trimmer, comms=comms, plan=plan,
                        autocast=autocast, hybrid=hybrid_engine(cfg.hybrid_engine, model),
                        compression=compression)
    engine_cls: type[Engine] = Engine
    if plan.pipelined:
        from .pipeline_engine import PipelineEngine

        engine_cls = PipelineEngine
    return engine_cls(model, cfg, batch, parts, grids.dp_group, device, compute)


def _finish(engine: Engine, cfg: ZeroSpeedConfig, args: Any) -> None:
    """What DeepSpeed does after building: ``args.local_rank``, rank 0's notes, activation checkpointing."""
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank  # as DeepSpeed: scripts read args.local_rank after initialize()
    if comm.get_rank() == 0:
        log_accepted_hints(cfg)
        if cfg.vocabulary_size and cfg.vocabulary_size % 8:
            warnings.warn(f"vocabulary_size {cfg.vocabulary_size} is not a multiple of 8, which may lower tensor-core "
                          "utilization (DeepSpeed's warning)")
        if cfg.dump_state:
            print(engine_state(engine), flush=True)
    if "activation_checkpointing" in cfg.model_fields_set:  # the engine's own, made the process default
        engine.activation_checkpointing.configure(cfg.activation_checkpointing, mp_world_size=1, timers=engine.timers)
        checkpointing.set_default(engine.activation_checkpointing)


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: Any = None, config_params: Any = None,
               **kwargs: Any) -> tuple[Engine, Any, Any, Any]:
    """DeepSpeed's contract: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    model, optimizer = _model_and_optimizer(model, optimizer, model_parameters, kwargs)
    early = load_config(_config_from(args, config, config_params))  # checked before any process group exists
    if early.log_level is not None:  # DeepSpeed's log_level: the library logger and its handlers, from here on
        set_log_level_from_string(early.log_level)
    _joined(dist_init_required, distributed_port, early)
    check_data_parallel_size(early, comm.get_world_size())
    early = prefer_client_objects(early, optimizer, lr_scheduler)  # DeepSpeed's rule: the client object wins
    from ..parallel.expert.auto import autoep_model

    autoep_model(early.expert_parallel, model)  # AutoEP: HF MoE blocks' experts -> expert-parallel grouped ones
    plan = plan_training(early, model_facts(early, model, mpu, optimizer, lr_scheduler))
    grids = Grids(plan, early, model, mpu)
    cfg = load_config(early, grids.data_size)  # the batch sizes, over the data-parallel replicas
    check_same_model(model, grids.dp_group)  # before any parameter collective (runtime/lockstep.py)
    from .autotuning_probe import profile_model_info

    profile_model_info(cfg, model)  # an autotuner's model-info run ends here
    device = get_accelerator().device()
    check_graph_harvesting(cfg.graph_harvesting, device)
    autocast = AutocastRegion.from_config(cfg.torch_autocast, device.type)  # torch_autocast (precision/autocast.py)
    # DeepSpeed: with sequence parallelism, seq_parallel_communication_data_type replaces communication_data_type
    comm_type = cfg.seq_parallel_communication_data_type if plan.sequence else cfg.communication_data_type
    policy = make_policy(cfg.fp16.enabled, cfg.bf16.enabled, comm_type,
                         autocast.dtype if autocast.enabled else None,
                         cfg.fp16.fp16_master_weights_and_grads or cfg.bf16.bf16_master_weights_and_grads,
                         cfg.bf16.bf16_optimizer_states, cfg.data_types.resolved_grad_accum_dtype())
    limit_heap_retention()  # freed tensors leave the host RSS (accelerator/host_malloc.py)
    compression = compression_runtime(cfg, model, grids.dp_group)  # before placement: quantize_training swaps layers
    fp8_modules = fp8_linears(cfg, model, device)
    stage3 = place_model(plan, cfg, model, policy.compute, device, grids.dp_group, grids.dp_rank, grids.moe)
    raw_groups = optimizer_groups(cfg, model, model_parameters, optimizer, grids.moe)
    trimmer = HeapTrimmer.for_device(device, cfg.zero_stage, num_params=module_params(model))  # host: heap back
    zero_opt, base = optimizer_stack(plan, cfg, grids, stage3, policy, model, raw_groups, optimizer, trimmer, autocast)
    scheduler = build_scheduler(cfg, lr_scheduler, base)
    loader = training_loader(cfg, training_data, cfg.batch(grids.data_size), grids, collate_fn, zero_opt)
    engine = _engine(plan, cfg, model, grids, zero_opt, scheduler, loader, stage3, fp8_modules, device, policy.compute,
                     trimmer, autocast, compression)
    _finish(engine, cfg, args)
    return engine, zero_opt, loader, scheduler
