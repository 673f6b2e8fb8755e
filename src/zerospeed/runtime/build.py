"""initialize(): the one place that reads the whole config and wires the parts together."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .. import comm
from ..accelerator import get_accelerator
from ..config import ConfigError, ZeroSpeedConfig, load_config
from ..config.errors import NotSupportedYetError
from ..precision import LossScaler, NoScaler, make_policy
from ..zero import GradReducer, ReduceSettings, ShardedGroup, ZeroOptimizer
from .dataloader import build_dataloader
from .engine import Engine

_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop,
                torch.optim.Adamax)


def _config_from(args: Any, config: Any, config_params: Any) -> Any:
    if config is None and config_params is not None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "zerospeed_config", None)
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
        # Keep the client's object (schedulers built on it keep working): point its groups at the masters.
        for group, new in zip(client.param_groups, masters):
            group["params"] = new["params"]
        client.state.clear()
        return client
    if cfg.optimizer is None:
        return None
    from ..optim import build_optimizer

    return build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), masters)


def _check_zero_optimizer(cfg: ZeroSpeedConfig, opt: torch.optim.Optimizer) -> None:
    if cfg.zero_stage == 0 or isinstance(opt, _ELEMENTWISE):
        return
    if not cfg.zero_allow_untested_optimizer:
        raise ConfigError(
            "zero_allow_untested_optimizer",
            f"{type(opt).__name__} is not an element-wise optimizer, so its result on a ZeRO stage-"
            f"{cfg.zero_stage} shard may differ from one process (per-tensor norms see only a shard). "
            "Use Adam/AdamW/SGD/Adagrad, stage 0, or set zero_allow_untested_optimizer: true.",
        )
    warnings.warn(f"{type(opt).__name__} under ZeRO stage {cfg.zero_stage}: per-tensor statistics see shards only")


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
    src = 0
    for t in [*module.parameters(), *module.buffers()]:
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
                 dp_group: comm.Group | None, dp_rank: int) -> Any:
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
    return setup_stage3(model, cfg.zero_optimization, compute, device, dp_group, home)


def _build_groups(cfg: ZeroSpeedConfig, raw_groups: list[dict[str, Any]], stage3: Any, compute: torch.dtype,
                  dp_size: int, dp_rank: int) -> tuple[list[ShardedGroup | None], list[dict[str, Any]]]:
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
    for g in raw_groups:
        trainable = [p for p in g["params"] if p.requires_grad]
        options.append({k: v for k, v in g.items() if k != "params"})
        if not trainable:
            groups.append(None)
        elif stage3 is not None:
            groups.append(stage3.make_group(trainable, options[-1], dp_rank, bucket, defer_master=on_disk,
                                            separate_master=separate))
        else:
            groups.append(ShardedGroup(trainable, options[-1], partitions, dp_rank, bucket, compute,
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
    return (device == "nvme" and cfg.zero_stage >= 2) or (device == "cpu" and on_accelerator)


def _build_zero_optimizer(cfg: ZeroSpeedConfig, base: torch.optim.Optimizer, live: list[ShardedGroup], stage3: Any,
                          policy: Any, dp_group: comm.Group | None, dp_size: int, dp_rank: int) -> ZeroOptimizer:
    if not live:
        raise ValueError("the model has no trainable parameters (every requires_grad is False)")
    _check_zero_optimizer(cfg, base)
    zcfg = cfg.zero_optimization
    overlap = True if cfg.zero_stage == 0 or zcfg.overlap_comm is None else zcfg.overlap_comm
    settings = ReduceSettings(stage=cfg.zero_stage, dp_size=dp_size, accum_dtype=policy.accum, comm_dtype=policy.comm,
                              reduce_scatter=zcfg.reduce_scatter, overlap_comm=overlap,
                              prescale_gradients=cfg.prescale_gradients,
                              gradient_predivide_factor=cfg.gradient_predivide_factor,
                              partition_sink=_gradients_off_device(cfg, live))
    reducer = GradReducer(live, settings, dp_group) if stage3 is None else stage3.make_reducer(live, settings)
    scaler = LossScaler.from_config(cfg.fp16) if policy.uses_loss_scaling else NoScaler()
    zero_opt = ZeroOptimizer(live, base, reducer, scaler, dp_group, cfg.gradient_clipping, policy.compute,
                             zcfg.allgather_bucket_size)
    zero_opt.allgather_partitions = zcfg.allgather_partitions
    if zcfg.offload_optimizer.enabled:
        from ..offload import OffloadStepper

        zero_opt.stepper = OffloadStepper(live, base, zcfg.offload_optimizer, cfg.aio, zcfg.sub_group_size, dp_group,
                                          dp_rank, stream_grads=settings.partition_sink)
        reducer.sink = zero_opt.stepper.sink  # where reduced gradients go instead of device partitions (or None)
    return zero_opt


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: Any = None, config_params: Any = None,
               **kwargs: Any) -> tuple[Engine, Any, Any, Any]:
    """DeepSpeed's contract: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    if model is None:
        raise ValueError("initialize() needs model=<torch.nn.Module>")
    if mpu is not None:
        raise NotSupportedYetError("mpu", "model parallelism (mpu) is not supported yet by zerospeed")
    if kwargs:
        raise TypeError(f"initialize() got unexpected arguments: {sorted(kwargs)}")
    if optimizer is not None and callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters() if model_parameters is None else model_parameters)
    raw_config = _config_from(args, config, config_params)
    early = load_config(raw_config)  # validated before any process group exists; batch sizes checked below
    _join(dist_init_required, distributed_port, early.comms_timeout_s)
    dp_group = comm.world_group()
    dp_size, dp_rank = comm.get_world_size(dp_group), comm.get_rank(dp_group)
    cfg = load_config(early, dp_size)
    if cfg.comms_timeout_s is not None:
        comm.set_timeout(cfg.comms_timeout_s, dp_group)
    batch = cfg.batch(dp_size)
    policy = make_policy(cfg.fp16.enabled, cfg.bf16.enabled, cfg.communication_data_type)
    device = get_accelerator().device()
    stage3 = _place_model(cfg, model, policy.compute, device, dp_group, dp_rank)
    raw_groups = _param_groups(model, model_parameters, optimizer)
    _check_ownership(model, raw_groups)
    groups, options = _build_groups(cfg, raw_groups, stage3, policy.compute, dp_size, dp_rank)
    live = [g for g in groups if g is not None]
    base = _build_base_optimizer(cfg, optimizer, groups, options)
    zero_opt = None if base is None else _build_zero_optimizer(cfg, base, live, stage3, policy, dp_group, dp_size,
                                                               dp_rank)
    scheduler = _build_scheduler(cfg, lr_scheduler, base)
    comm.COMMS_LOGGER.configure(cfg.comms_logger.enabled, cfg.comms_logger.verbose, cfg.comms_logger.prof_all,
                                cfg.comms_logger.prof_ops)
    loader = None
    if training_data is not None:
        loader = build_dataloader(training_data, batch.micro_batch_per_gpu, dp_rank, dp_size, collate_fn,
                                  cfg.dataloader_drop_last, seed=cfg.seed or 0)
    engine = Engine(model, cfg, batch, zero_opt, scheduler, dp_group, device, policy.compute, loader)
    engine.zero3 = stage3
    if "activation_checkpointing" in cfg.model_fields_set:
        from .. import checkpointing

        checkpointing.configure(cfg.activation_checkpointing, mp_world_size=1, timers=engine.timers)
    return engine, zero_opt, loader, scheduler
