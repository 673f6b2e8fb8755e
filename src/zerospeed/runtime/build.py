"""initialize(): the one place that reads the whole config and wires the parts together."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .. import comm
from ..accelerator import get_accelerator
from ..accelerator.host_malloc import limit_heap_retention
from ..config import ConfigError, ZeroSpeedConfig, load_config
from ..config.errors import NotSupportedYetError
from ..config.hints import log_accepted_hints
from ..optim.frozen_variance import check_freeze_variance
from ..precision import LossScaler, NoScaler, make_policy
from ..zero import GradReducer, ReduceSettings, ShardedGroup, ZeroOptimizer
from ..zero.topk_momentum import install_momentum_exchange
from .dataloader import build_dataloader
from .engine import Engine
from .lockstep import check_same_model
from .state_dump import engine_state

_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop,
                torch.optim.Adamax)


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


def _param_groups(module: nn.Module, model_parameters: Any, optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    """Normalise whatever the user passed into a list of {'params': [...], **options}."""
    if optimizer is not None:
        return [dict(g) for g in optimizer.param_groups]
    if model_parameters is None:
        return [{"params": list(module.parameters())}]
    items = list(model_parameters) if isinstance(model_parameters, Iterable) else [model_parameters]
    if items and isinstance(items[0], dict):
        return [{**g, "params": list(g["params"])} for g in items]
    return [{"params": items}]


def _check_ownership(module: nn.Module, groups: list[dict[str, Any]]) -> None:
    owned = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    for gi, g in enumerate(groups):
        for p in g["params"]:
            if id(p) not in owned:
                raise ValueError(f"parameter group {gi} holds a tensor that is not a parameter of the model")
            if id(p) in seen:
                raise ValueError(f"a parameter appears in more than one parameter group (group {gi})")
            seen.add(id(p))


def _build_base_optimizer(cfg: ZeroSpeedConfig, client: torch.optim.Optimizer | None,
                          groups: list[ShardedGroup], options: list[dict[str, Any]]) -> torch.optim.Optimizer | None:
    masters = [{**opts, "params": g.master_params if g is not None else []} for g, opts in zip(groups, options)]
    if client is not None:
        if cfg.optimizer is not None:
            raise ConfigError("optimizer", "both a client optimizer and an 'optimizer' config section were given; keep one")
        _check_client_offload(cfg, client)
        # Keep the client's object (schedulers built on it keep working): point its groups at the masters.
        for group, new in zip(client.param_groups, masters):
            group["params"] = new["params"]
        client.state.clear()
        return client
    if cfg.optimizer is None:
        return None
    from ..optim import build_optimizer

    return build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), masters)


def _check_client_offload(cfg: ZeroSpeedConfig, client: torch.optim.Optimizer) -> None:
    """DeepSpeed's ``zero_force_ds_cpu_optimizer`` (default true): under ZeRO-Offload a client optimizer must
    be one the fast CPU step runs (here: one with a flat CPU kernel, Adam/AdamW/Adagrad), or the user says
    false to run its own ``step()`` on the host."""
    if not (cfg.zero_optimization.offload_optimizer.enabled and cfg.zero_force_ds_cpu_optimizer):
        return
    from ..offload.cpu_adam import kernel_for

    if kernel_for(client) is None:
        raise ConfigError("zero_force_ds_cpu_optimizer", f"ZeRO-Offload with a client optimizer "
                          f"({type(client).__name__}) that has no fast CPU kernel runs its own step() on the host, "
                          "usually slowly. Use Adam, AdamW or Adagrad, set the optimizer in the config, or set "
                          "\"zero_force_ds_cpu_optimizer\": false to run it anyway (as in DeepSpeed).")


def _check_zero_optimizer(cfg: ZeroSpeedConfig, opt: torch.optim.Optimizer) -> None:
    if hasattr(opt, "shard_orthogonalizer"):  # Muon: whole matrices orthogonalised by owner ranks (exact)
        if cfg.zero_optimization.offload_optimizer.device == "nvme":
            raise NotSupportedYetError("zero_optimization.offload_optimizer.device", "Muon with the optimizer "
                                       "offloaded to NVMe is not supported yet by zerospeed (cpu offload is)")
        return
    if cfg.zero_stage == 0 or isinstance(opt, _ELEMENTWISE):
        return
    if hasattr(opt, "shard_norm_reducer"):  # Lamb: per-tensor norms are summed over the shards (exact)
        return
    if not cfg.zero_allow_untested_optimizer:
        raise ConfigError(
            "zero_allow_untested_optimizer",
            f"{type(opt).__name__} is not an element-wise optimizer, so its result on a ZeRO stage-"
            f"{cfg.zero_stage} shard may differ from one process (per-tensor norms see only a shard). "
            "Use Adam/AdamW/SGD/Adagrad, stage 0, or set zero_allow_untested_optimizer: true.",
        )
    warnings.warn(f"{type(opt).__name__} under ZeRO stage {cfg.zero_stage}: per-tensor statistics see shards only")


def _muon_groups(cfg: ZeroSpeedConfig, model: nn.Module, raw_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DeepSpeed's Muon/Adam halves of each group, tagged by the layers' full shapes (optim/muon_groups.py)."""
    from ..optim.muon_groups import split_muon_groups, tag_use_muon
    from ..zero.stage3 import shard_of

    def full_shape(p: nn.Parameter) -> torch.Size:
        s = shard_of(p)
        return p.shape if s is None else s.shape

    tag_use_muon(model, full_shape)
    return split_muon_groups(raw_groups, dict(cfg.optimizer.params) if cfg.optimizer is not None else {})


def _build_scheduler(cfg: ZeroSpeedConfig, client: Any, opt: torch.optim.Optimizer | None) -> Any:
    if client is not None:
        if cfg.scheduler is not None:
            raise ConfigError("scheduler", "both a client lr_scheduler and a 'scheduler' config section were given; keep one")
        return client(opt) if callable(client) and not hasattr(client, "step") else client
    if cfg.scheduler is None:
        return None
    if opt is None:
        raise ConfigError("scheduler", "a scheduler needs an optimizer")
    from ..optim import build_scheduler

    return build_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), opt)


def _param_home(cfg: ZeroSpeedConfig, model: nn.Module, dtype: torch.dtype, rank: int) -> Any:
    """ZeRO-Infinity: the home of the parameter shards (the one ``zero.Init`` made, or a new one)."""
    from ..offload.param_home import ParamHome
    from ..zero.stage3 import shard_of

    shards = [shard_of(p) for p in model.parameters()]
    for s in shards:
        if s is not None and s.home is not None:
            return s.home
    dp = comm.get_world_size(comm.world_group())
    need = sum(((p.numel() + dp - 1) // dp * dtype.itemsize + 4095) // 4096 * 4096 for p in model.parameters())
    return ParamHome(cfg.zero_optimization.offload_param, cfg.aio, rank, need_bytes=need)


@torch.no_grad()
def _sync_module(module: nn.Module, group: comm.Group | None) -> None:
    """Every rank starts from rank 0's parameters and buffers."""
    if comm.get_world_size(group) == 1:
        return
    src = comm.global_rank_of(group, 0)
    for t in [*module.parameters(), *module.buffers()]:
        if getattr(t, "allreduce", True) is False:  # an MoE expert's: synced within its expert-data group
            continue
        comm.broadcast(t.data, src=src, group=group)


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


def _place_model(cfg: ZeroSpeedConfig, model: nn.Module, compute: torch.dtype, device: torch.device,
                 dp_group: comm.Group | None, dp_rank: int, moe: Any = None) -> Any:
    """Cast and place the module and give every rank rank 0's values; under stage 3 also cut it."""
    offload_param = cfg.zero_optimization.offload_param
    if offload_param.enabled and cfg.zero_stage != 3:
        raise ConfigError("zero_optimization.offload_param", f"parameter offload needs ZeRO stage 3 (parameters "
                          f"partitioned), got stage {cfg.zero_stage}; set zero_optimization.stage to 3 or remove "
                          "offload_param")
    if cfg.zero_stage != 3:
        model.to(device=device, dtype=compute)
        _sync_module(model, dp_group)
        return None
    from ..zero.stage3 import setup_stage3  # parameters partitioned too: cut them, install module hooks

    home = _param_home(cfg, model, compute, dp_rank) if offload_param.enabled else None
    group_of = None if moe is None else moe.partition_groups(model)  # experts: over their expert-data group
    return setup_stage3(model, cfg.zero_optimization, compute, device, dp_group, home, group_of)


def _reduce_bucket(cfg: ZeroSpeedConfig, params: list[nn.Parameter], world: int) -> int:
    """At most 1/8 of the gradient (``reduce_bucket_numel``); top-k (it selects per bucket): one bucket."""
    from ..zero.partition import reduce_bucket_numel
    from ..zero.stage3.param_store import shard_of
    numels = [s.numel if (s := shard_of(p)) is not None else p.numel() for p in params]
    replicas = 1 if cfg.gradient_compression.type == "topk" else world
    return reduce_bucket_numel(cfg.zero_optimization.reduce_bucket_size, numels, cfg.zero_stage, replicas)


def _build_groups(cfg: ZeroSpeedConfig, raw_groups: list[dict[str, Any]], stage3: Any, compute: torch.dtype,
                  dp_size: int, dp_rank: int, moe: Any = None) -> tuple[list[ShardedGroup | None], list[dict[str, Any]]]:
    """One sharded group per optimizer param group (None where nothing in it trains), and its options."""
    bucket = cfg.zero_optimization.reduce_bucket_size
    partitions = 1 if cfg.zero_stage == 0 else dp_size
    groups: list[ShardedGroup | None] = []
    options: list[dict[str, Any]] = []
    # NVMe offload: the fp32 master goes straight to the swap files (never whole in memory). Offload with the
    # model on an accelerator: the master is never the model itself (it lives on the host).
    offload_device = cfg.zero_optimization.offload_optimizer.device
    on_disk = offload_device == "nvme" and cfg.zero_stage > 0
    separate = offload_device != "none" and get_accelerator().device().type != "cpu"
    separate = separate or cfg.zero_optimization.zenflow is not None  # ZenFlow steps a flat master
    for g in raw_groups:
        trainable = [p for p in g["params"] if p.requires_grad]
        options.append({k: v for k, v in g.items() if k != "params"})
        if not trainable:
            groups.append(None)
        elif moe is not None and moe.expert_groups_of(trainable) is not None:  # partitioned over its edp group
            groups.append(moe.sharded_group(trainable, options[-1], cfg.zero_stage, bucket, compute, stage3,
                                            defer_master=on_disk, separate_master=separate))
        elif stage3 is not None:
            groups.append(stage3.make_group(trainable, options[-1], dp_rank, _reduce_bucket(cfg, trainable, dp_size),
                                            defer_master=on_disk, separate_master=separate))
        else:
            groups.append(ShardedGroup(trainable, options[-1], partitions, dp_rank,
                                       _reduce_bucket(cfg, trainable, dp_size), compute,
                                       defer_master=on_disk, separate_master=separate))
    offload = cfg.zero_optimization.offload_optimizer
    if offload.enabled:  # ZeRO-Offload: fp32 masters on host before the optimizer is built over them
        if cfg.zero_stage == 0:
            raise ConfigError("zero_optimization.offload_optimizer", "offload needs ZeRO stage 1, 2 or 3")
        from ..offload import move_master_to_host

        for group in groups:
            if group is not None:
                # nvme parks the master on disk (its host copy is freed): pinning it would buy nothing
                move_master_to_host(group, offload.pin_memory and offload.device != "nvme")
    return groups, options


def _gradients_off_device(cfg: ZeroSpeedConfig, live: list[ShardedGroup]) -> bool:
    """Whether the reduced gradients bypass device partition buffers: nvme offload at stages 2-3 (to the swap
    files), cpu offload with the model on an accelerator (to host partitions)."""
    device = cfg.zero_optimization.offload_optimizer.device
    on_accelerator = any(g.device.type != "cpu" for g in live)
    partial = cfg.zero_optimization.offload_optimizer.ratio < 1.0  # the device share steps device gradients
    return (device == "nvme" and cfg.zero_stage >= 2) or (device == "cpu" and on_accelerator and not partial)


def _build_zero_optimizer(cfg: ZeroSpeedConfig, base: torch.optim.Optimizer, live: list[ShardedGroup], stage3: Any,
                          policy: Any, dp_group: comm.Group | None, dp_size: int, dp_rank: int,
                          moe: Any = None) -> ZeroOptimizer:
    if not live:
        raise ValueError("the model has no trainable parameters (every requires_grad is False)")
    _check_zero_optimizer(cfg, base)
    zcfg = cfg.zero_optimization
    overlap = True if zcfg.overlap_comm is None else zcfg.overlap_comm  # an explicit false is honoured
    settings = ReduceSettings(stage=cfg.zero_stage, dp_size=dp_size, accum_dtype=policy.accum, comm_dtype=policy.comm,
                              reduce_scatter=zcfg.reduce_scatter, overlap_comm=overlap,
                              prescale_gradients=cfg.prescale_gradients,
                              gradient_predivide_factor=cfg.gradient_predivide_factor,
                              partition_sink=_gradients_off_device(cfg, live), **_topk(cfg, base))
    if cfg.zero_local_grad_accumulation:
        settings = _local_accumulation(cfg, settings)
    if moe is not None:  # dense gradients over the data-parallel group, experts' over their edp groups
        reducer = moe.make_reducer(live, settings, stage3)
    else:
        reducer = GradReducer(live, settings, dp_group) if stage3 is None else stage3.make_reducer(live, settings)
    reducer.ignore_unused_parameters = zcfg.ignore_unused_parameters
    if not zcfg.ignore_unused_parameters and cfg.zero_stage not in (1, 2):
        warnings.warn(f"zero_optimization.ignore_unused_parameters: false has no effect at ZeRO stage {cfg.zero_stage} "
                      "(as in DeepSpeed, it checks stages 1 and 2 only)")
    scaler = LossScaler.from_config(cfg.fp16) if policy.uses_loss_scaling else NoScaler()
    zero_opt = ZeroOptimizer(live, base, reducer, scaler, dp_group, cfg.gradient_clipping, policy.compute,
                             zcfg.allgather_bucket_size)
    zero_opt.allgather_partitions = zcfg.allgather_partitions
    install_momentum_exchange(cfg.gradient_compression, zero_opt, dp_group)
    zero_opt.check_grad_overflow = cfg.fp16.enabled or (cfg.bf16.enabled and cfg.bf16.check_grad_overflow)
    if zcfg.offload_optimizer.enabled:
        from ..offload import OffloadStepper

        stepper_args = (live, base, zcfg.offload_optimizer, cfg.aio, zcfg.sub_group_size, dp_group, dp_rank)
        if zcfg.zenflow is not None:
            from ..offload.zenflow import ZenFlowStepper

            if moe is not None:
                raise NotSupportedYetError("zero_optimization.zenflow", "ZenFlow with MoE expert parameters is not "
                                           "supported yet by zerospeed")

            zero_opt.stepper = ZenFlowStepper(*stepper_args, stream_grads=settings.partition_sink, zenflow=zcfg.zenflow)
        else:
            zero_opt.stepper = OffloadStepper(*stepper_args, stream_grads=settings.partition_sink)
        reducer.sink = zero_opt.stepper.sink  # where reduced gradients go instead of device partitions (or None)
    return zero_opt if moe is None else moe.wrap_optimizer(zero_opt)


def _local_accumulation(cfg: ZeroSpeedConfig, settings: ReduceSettings) -> ReduceSettings:
    """``zero_local_grad_accumulation`` (zerospeed only): stage 2 accumulates locally, reduces per boundary."""
    if cfg.zero_stage != 2 or settings.partition_sink:
        if cfg.zero_stage == 3 or settings.partition_sink:
            warnings.warn("zero_local_grad_accumulation has no effect here (it applies to ZeRO stage 2 with the "
                          "gradients in device memory; stages 0-1 always accumulate locally)")
        return settings
    return dataclasses.replace(settings, local_accumulation=True)


def _moe_training(cfg: ZeroSpeedConfig, model: nn.Module, dp_group: comm.Group | None, grid: Any = None) -> Any:
    """Expert groups and gradient routing when the model holds MoE layers (None otherwise)."""
    from ..parallel.expert.training import MoETraining, moe_layers

    if not moe_layers(model):
        return None
    return MoETraining(model, dp_group, cfg.zero_stage, cfg.zero_optimization.offload_optimizer.device,
                       cfg.use_data_before_expert_parallelism, grid)


def _topk(cfg: ZeroSpeedConfig, base: Any) -> dict[str, Any]:
    """``gradient_compression`` (zerospeed only): top-k sparsified gradient averaging, stages 0 and 1."""
    gc = cfg.gradient_compression
    if gc.type == "none":
        return {}
    if cfg.zero_stage > 1:
        raise ConfigError("gradient_compression", f"top-k works with ZeRO stages 0 and 1, got stage {cfg.zero_stage}")
    check_freeze_variance(gc, base, cfg.zero_optimization.offload_optimizer.enabled)
    return {"topk_ratio": gc.ratio, "topk_error_feedback": gc.error_feedback, "topk_warmup_steps": gc.warmup_steps,
            "topk_freeze_variance": gc.freeze_variance, "topk_momentum_correction": gc.momentum_correction,
            "topk_preconditioned_selection": gc.preconditioned_selection}


def _check_compressing(cfg: ZeroSpeedConfig, base: Any) -> bool:
    """Whether ``base`` is a 1-bit optimizer (it averages compressed momentum itself); DeepSpeed forbids ZeRO."""
    if not getattr(base, "compresses_communication", False):
        return False
    if cfg.zero_stage > 0:
        raise ConfigError("zero_optimization.stage", f"{base.deepspeed_name} is not compatible with ZeRO (as in "
                          f"DeepSpeed; got stage {cfg.zero_stage}): use stage 0")
    return True


def _parallel_grid(model: nn.Module, mpu: Any) -> Any:
    """The process grid when the model is a PipelineModule (its own grid) or an ``mpu`` is given, else None."""
    from ..parallel.pipeline.module import PipelineModule

    if isinstance(model, PipelineModule):
        if mpu is not None and mpu is not model.mpu():
            raise ValueError("initialize(mpu=...) with a PipelineModule: the module already defines the grid "
                             "(pass topology= to PipelineModule instead)")
        return model.mpu()
    if mpu is None:
        return None
    for name in ("get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank"):
        if not callable(getattr(mpu, name, None)):
            raise ValueError(f"initialize(mpu=...): the object has no {name}() (expected an mpu such as "
                             "zerospeed.runtime.pipe.topology.PipelineParallelGrid)")
    tp = getattr(mpu, "get_model_parallel_world_size", lambda: 1)()
    from ..parallel.expert.training import moe_layers

    if tp != 1 and not any(m.enable_expert_tensor_parallelism for m in moe_layers(model)):  # expert TP: parallel/expert
        raise NotSupportedYetError("mpu", f"model parallelism through mpu (model-parallel world size {tp}) is not "
                                   "supported yet by zerospeed; only data-parallel groups from an mpu are")
    return mpu


def _sequence_grid(cfg: ZeroSpeedConfig, model: nn.Module, mpu: Any) -> Any:
    """The (data, sequence) grid when ``sequence_parallel_size`` > 1 or ``mpu`` is a sequence-parallel grid
    (``parallel/sequence/groups.py``), else None. The two must agree when both are given."""
    from_mpu = mpu is not None and callable(getattr(mpu, "get_sequence_parallel_world_size", None))
    sp = mpu.get_sequence_parallel_world_size() if from_mpu else cfg.sequence_parallel_size
    if from_mpu and "sequence_parallel_size" in cfg.model_fields_set and cfg.sequence_parallel_size != sp:
        raise ConfigError("sequence_parallel_size", f"{cfg.sequence_parallel_size} but the mpu passed to "
                          f"initialize() has a sequence group of {sp}; make them equal")
    if sp == 1 and not from_mpu:
        return None
    from ..parallel.pipeline.module import PipelineModule

    if isinstance(model, PipelineModule):
        raise NotSupportedYetError("sequence_parallel_size", "sequence parallelism with a PipelineModule is not "
                                   "supported yet by zerospeed")
    if from_mpu:
        return mpu
    if mpu is not None:
        raise NotSupportedYetError("sequence_parallel_size", "sequence_parallel_size with an mpu that has no "
                                   "sequence groups is not supported yet by zerospeed")
    from ..parallel.sequence.groups import SequenceParallelGrid

    return SequenceParallelGrid(sp)
def _fp8(cfg: ZeroSpeedConfig, model: nn.Module, device: torch.device) -> list[str]:
    """The ``fp8`` section: convert the linears (names returned) and check the weight all-gather option."""
    f = cfg.fp8
    if f.allgather_fp8 and cfg.zero_stage != 3:
        raise ConfigError("fp8.allgather_fp8", f"the fp8 weight all-gather needs ZeRO stage 3 (weights partitioned "
                          f"and gathered), got stage {cfg.zero_stage}")
    if f.allgather_fp8 and (cfg.zero_optimization.zero_quantized_weights
                            or cfg.zero_optimization.zero_quantized_nontrainable_weights):
        raise ConfigError("fp8.allgather_fp8", "both fp8.allgather_fp8 and ZeRO++ zero_quantized_weights quantise "
                          "the weight all-gather; keep one")
    if not f.enabled:
        return []
    from ..precision.fp8 import convert_to_float8

    return convert_to_float8(model, f, device)


def _tensor_parallel(cfg: ZeroSpeedConfig, model: nn.Module, grid: Any) -> Any:
    """AutoTP (``tensor_parallel`` section or ``tp_model_init``): split the model over the grid's model axis."""
    from ..parallel.tensor.training import TensorParallelTraining, tp_requested

    if not tp_requested(model, cfg.tensor_parallel):
        return None
    if cfg.zero_stage == 3:
        raise NotSupportedYetError("zero_optimization.stage", "tensor parallelism with ZeRO stage 3 is not supported "
                                   "yet by zerospeed; use stage 0, 1 or 2")
    if grid is not None and grid is not getattr(model, "_grid", None):
        raise NotSupportedYetError("tensor_parallel", "tensor parallelism with an mpu is not supported yet by "
                                   "zerospeed (a PipelineModule's topology with a 'model' axis is)")
    return TensorParallelTraining(model, cfg.tensor_parallel, grid)


def _data_efficiency(cfg: ZeroSpeedConfig, global_batch: int, pipelined: bool) -> Any:
    """Curriculum / progressive layer drop / random-LTD schedules (data_pipeline/runtime.py), or None."""
    from ..data_pipeline.runtime import DataEfficiency

    state = DataEfficiency(cfg.curriculum_learning, cfg.progressive_layer_drop, cfg.data_efficiency, global_batch)
    if not state.active:
        return None
    if pipelined:
        raise NotSupportedYetError("curriculum_learning", "curriculum_learning, progressive_layer_drop and random-LTD "
                                   "with a PipelineModule are not supported yet by zerospeed")
    return state


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: Any = None, config_params: Any = None,
               **kwargs: Any) -> tuple[Engine, Any, Any, Any]:
    """DeepSpeed's contract: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    if model is None:
        raise ValueError("initialize() needs model=<torch.nn.Module>")
    if kwargs:
        raise TypeError(f"initialize() got unexpected arguments: {sorted(kwargs)}")
    if optimizer is not None and callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters() if model_parameters is None else model_parameters)
    raw_config = _config_from(args, config, config_params)
    early = load_config(raw_config)  # validated before any process group exists; batch sizes checked below
    _join(dist_init_required, distributed_port, early.comms_timeout_s)
    if early.comms_timeout_s is not None:
        comm.set_timeout(early.comms_timeout_s, comm.world_group())
    seq_grid = _sequence_grid(early, model, mpu)
    grid = _parallel_grid(model, mpu) if seq_grid is None else None
    tp = _tensor_parallel(early, model, grid)
    if tp is not None and seq_grid is not None:
        raise NotSupportedYetError("sequence_parallel_size", "Ulysses sequence parallelism together with tensor "
                                   "parallelism is not supported yet by zerospeed")
    grid = tp.grid if tp is not None and grid is None else grid
    # The engine's own connections (docs/recovery.md): dropped and rebuilt after a failed step, leaving the
    # world group the user's code talks on untouched. A pipeline or a user's mpu brings its grid's groups.
    # Under sequence parallelism ZeRO partitions and reduces over every rank (data x sequence, DeepSpeed's
    # seq_data_parallel_group): the average over it is the sum over a sequence group of its ranks' losses
    # averaged over the group, so a per-rank mean loss gives the unsharded gradient.
    if grid is None and seq_grid is None:  # the batch rules fail on every rank before a new group connects (a rank
        load_config(early, comm.get_world_size())  # leaving while its peer is still connecting breaks the peer)
    dp_group = comm.RecoverableGroup(early.comms_timeout_s) if grid is None else grid.get_data_parallel_group()
    dp_size, dp_rank = comm.get_world_size(dp_group), comm.get_rank(dp_group)
    # Samples: sequence peers share theirs, so batch sizes and the data loader count data-parallel replicas.
    data_size, data_rank = ((dp_size, dp_rank) if seq_grid is None else
                            (seq_grid.get_data_parallel_world_size(), seq_grid.get_data_parallel_rank()))
    cfg = load_config(early, data_size)
    check_same_model(model, dp_group)  # before any parameter collective (runtime/lockstep.py)
    from .autotuning_probe import profile_model_info

    profile_model_info(cfg, model)  # an autotuner's model-info run ends here
    pipelined = grid is not None and grid is getattr(model, "_grid", None)
    if pipelined and cfg.zero_stage >= 2:
        raise ConfigError("zero_optimization.stage", "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism "
                          f"(got stage {cfg.zero_stage}); use stage 0 or 1")
    if grid is not None and cfg.comms_timeout_s is not None:
        comm.set_timeout(cfg.comms_timeout_s, dp_group)
    batch = cfg.batch(data_size)
    policy = make_policy(cfg.fp16.enabled, cfg.bf16.enabled, cfg.communication_data_type)
    device = get_accelerator().device()
    limit_heap_retention()  # freed tensors leave the host RSS (accelerator/host_malloc.py)
    moe = _moe_training(cfg, model, dp_group, grid)
    if moe is not None and seq_grid is not None:
        raise NotSupportedYetError("sequence_parallel_size", "sequence parallelism with Mixture-of-Experts layers "
                                   "is not supported yet by zerospeed")
    if moe is not None and tp is not None:
        raise NotSupportedYetError("tensor_parallel", "AutoTP with Mixture-of-Experts layers is not supported yet by "
                                   "zerospeed (expert tensor parallelism through an mpu is)")
    fp8_modules = _fp8(cfg, model, device)
    stage3 = _place_model(cfg, model, policy.compute, device, dp_group, dp_rank, moe)
    if stage3 is not None and cfg.fp8.allgather_fp8:
        for shard in stage3.shards:
            shard.quantize_gather = "fp8"
    raw_groups = _param_groups(model, model_parameters, optimizer)
    if optimizer is None and cfg.optimizer is not None and cfg.optimizer.type.lower() == "muon":
        raw_groups = _muon_groups(cfg, model, raw_groups)
    if moe is not None:
        moe.sync_experts(model)
        raw_groups = moe.split_groups(raw_groups, from_client=optimizer is not None)
    _check_ownership(model, raw_groups)
    groups, options = _build_groups(cfg, raw_groups, stage3, policy.compute, dp_size, dp_rank, moe)
    live = [g for g in groups if g is not None]
    base = _build_base_optimizer(cfg, optimizer, groups, options)
    tp_split = tp is not None or (grid is not None and getattr(grid, "get_slice_parallel_world_size", lambda: 1)() > 1)
    if hasattr(base, "shard_orthogonalizer") and (moe is not None or tp_split):  # Muon on matrix pieces: wrong
        raise NotSupportedYetError("optimizer.type", "Muon with tensor parallelism or Mixture-of-Experts layers "
                                   "is not supported yet by zerospeed")
    compressing = _check_compressing(cfg, base)
    zero_opt = None if base is None else _build_zero_optimizer(cfg, base, live, stage3, policy, dp_group, dp_size,
                                                               dp_rank, moe)
    if compressing and zero_opt is not None:  # the optimizer decides when the engine all-reduces gradients
        if moe is not None:
            raise NotSupportedYetError("optimizer", f"{type(base).__name__} with Mixture-of-Experts layers is not "
                                       "supported yet by zerospeed")
        base.bind(dp_group)  # type: ignore[union-attr]
        zero_opt.reducer.allreduce_gate = base.wants_backward_allreduce  # type: ignore[union-attr]
    if pipelined and zero_opt is not None:  # one grad norm / overflow verdict over every stage
        from ..parallel.pipeline.optimizer import PipelineZeroOptimizer

        wrap = PipelineZeroOptimizer.wrap if moe is None else moe.wrap_pipeline  # MoE: its own norm, then stages
        zero_opt = wrap(zero_opt, grid.get_pipe_parallel_group(), model.replicated)
    if tp is not None and zero_opt is not None:  # one grad norm / overflow verdict over the split model
        zero_opt = tp.wrap_optimizer(zero_opt)
    scheduler = _build_scheduler(cfg, lr_scheduler, base)
    comm.COMMS_LOGGER.configure(cfg.comms_logger.enabled, cfg.comms_logger.verbose, cfg.comms_logger.prof_all,
                                cfg.comms_logger.prof_ops, cfg.comms_logger.debug)
    loader = None
    if training_data is not None and cfg.data_efficiency.data_sampling.curriculum_learning.enabled:
        from ..data_pipeline.sampler import build_curriculum_dataloader  # DeepSpeed's curriculum data sampler

        loader = build_curriculum_dataloader(cfg.data_efficiency, training_data, batch.micro_batch_per_gpu, data_rank,
                                             data_size, dp_group if seq_grid is None else seq_grid.get_data_parallel_group(),
                                             batch.gradient_accumulation_steps, collate_fn, cfg.dataloader_drop_last)
    elif cfg.data_efficiency.data_sampling.curriculum_learning.enabled:
        warnings.warn("data_efficiency.data_sampling.curriculum_learning is enabled but initialize() got no "
                      "training_data: the curriculum sampler drives only the training loader initialize() builds")
    if training_data is not None and loader is None:
        loader = build_dataloader(training_data, batch.micro_batch_per_gpu, data_rank, data_size, collate_fn,
                                  cfg.dataloader_drop_last, seed=cfg.seed or 0)
        if hasattr(getattr(zero_opt, "stepper", None), "set_steps_per_epoch") and hasattr(loader.dataset, "__len__"):
            zero_opt.stepper.set_steps_per_epoch(len(loader) // batch.gradient_accumulation_steps)  # ZenFlow's epochs
    if zero_opt is not None:
        zero_opt.reducer.names = {p: n for n, p in model.named_parameters()}
    engine_cls: type[Engine] = Engine
    if pipelined:
        from ..parallel.pipeline.engine import PipelineEngine

        engine_cls = PipelineEngine
    engine = engine_cls(model, cfg, batch, zero_opt, scheduler, dp_group, device, policy.compute, loader)
    engine.zero3 = stage3
    engine.fp8_modules = fp8_modules  # names of the linears computing in FP8 (the fp8 section)
    engine.data_efficiency = _data_efficiency(cfg, batch.train_batch_size, pipelined)
    if seq_grid is not None:
        engine.set_sequence_groups(seq_grid)
    if tp is not None:
        engine.tensor_parallel = tp
        engine.checkpoint_group = comm.world_group()  # every rank writes: tp shards x dp partitions
        engine.mp_world_size = tp.model.size
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank  # as DeepSpeed: scripts read args.local_rank after initialize()
    if comm.get_rank() == 0:
        log_accepted_hints(cfg)
        if cfg.vocabulary_size and cfg.vocabulary_size % 8:
            warnings.warn(f"vocabulary_size {cfg.vocabulary_size} is not a multiple of 8, which may lower tensor-core "
                          "utilization (DeepSpeed's warning)")
        if cfg.dump_state:
            print(engine_state(engine), flush=True)
    if "activation_checkpointing" in cfg.model_fields_set:
        from .. import checkpointing

        checkpointing.configure(cfg.activation_checkpointing, mp_world_size=1, timers=engine.timers)
    return engine, zero_opt, loader, scheduler
