"""Assembly of the optimizer stack: sharded groups -> base optimizer -> reducer -> ZeRO optimizer -> scheduler.

What is built follows the ``TrainPlan``; the refusals of unsupported combinations are rows of its table
(``runtime/plan.py``). The helpers that look at an optimizer object (``check_zero_optimizer``,
``check_compressing``, ``topk``) ask the same table about that optimizer alone.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch import nn

from .. import comm
from ..accelerator import get_accelerator
from ..config import ConfigError, ZeroSpeedConfig
from ..optim.frozen_variance import check_freeze_variance
from ..precision import GradScalerRule, LossScaler, NoScaler
from ..zero import GradReducer, ReducerWiring, ReduceSettings, ShardedGroup, ZeroOptimizer
from ..zero.norm_axes import NormAxes
from ..zero.reducer_parts import compressor_for, reducer_parts
from ..zero.topk_momentum import momentum_exchange_for
from .facts import built_optimizer_facts
from .plan import ModelFacts, TrainPlan, plan_training

_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop,
                torch.optim.Adamax)


def _plan_for(cfg: ZeroSpeedConfig, opt: Any) -> TrainPlan:
    """The plan's verdict on ``opt`` with this config alone (no parallelism)."""
    return plan_training(cfg, ModelFacts(optimizer=None if opt is None else built_optimizer_facts(opt)))


def check_zero_optimizer(cfg: ZeroSpeedConfig, opt: torch.optim.Optimizer) -> None:
    _plan_for(cfg, opt)
    if hasattr(opt, "shard_orthogonalizer"):  # Muon: whole matrices orthogonalised by owner ranks (exact)
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


def check_compressing(cfg: ZeroSpeedConfig, base: Any) -> bool:
    """Whether ``base`` is a 1-bit optimizer (it averages compressed momentum itself); DeepSpeed forbids ZeRO."""
    return _plan_for(cfg, base).compressing


def topk(cfg: ZeroSpeedConfig, base: Any) -> dict[str, Any]:
    """``gradient_compression`` (zerospeed only): top-k sparsified gradient averaging, stages 0 and 1."""
    if not _plan_for(cfg, base).topk:
        return {}
    gc = cfg.gradient_compression
    check_freeze_variance(gc, base, cfg.zero_optimization.offload_optimizer.enabled)
    return {"topk_ratio": gc.ratio, "topk_error_feedback": gc.error_feedback, "topk_warmup_steps": gc.warmup_steps,
            "topk_freeze_variance": gc.freeze_variance, "topk_momentum_correction": gc.momentum_correction,
            "topk_preconditioned_selection": gc.preconditioned_selection}


def _reduce_bucket(cfg: ZeroSpeedConfig, params: list[nn.Parameter], world: int) -> int:
    """At most 1/8 of the gradient (``reduce_bucket_numel``); top-k (it selects per bucket): one bucket."""
    from ..zero.partition import reduce_bucket_numel
    from ..zero.stage3.param_store import shard_of
    numels = [s.numel if (s := shard_of(p)) is not None else p.numel() for p in params]
    replicas = 1 if cfg.gradient_compression.type == "topk" else world
    return reduce_bucket_numel(cfg.zero_optimization.reduce_bucket_size, numels, cfg.zero_stage, replicas)


def build_groups(cfg: ZeroSpeedConfig, raw_groups: list[dict[str, Any]], stage3: Any, compute: torch.dtype,
                 dp_size: int, dp_rank: int, moe: Any = None,
                 master_dtype: torch.dtype = torch.float32, sparse: frozenset[int] = frozenset(),
                 lower: dict[int, torch.dtype] | None = None) -> tuple[list[ShardedGroup | None], list[dict[str, Any]]]:
    """One sharded group per optimizer param group (None where nothing in it trains), and its options;
    ``sparse`` (parameter ids: ``sparse_gradients``) each get a bucket of their own; ``lower`` (parameter
    ids: ``lower_precision_grads``) have their gradients reduced in the dtype it names."""
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
        dtypes = [lower.get(id(p)) for p in trainable] if lower else None
        if not trainable:
            groups.append(None)
        elif moe is not None and moe.expert_groups_of(trainable) is not None:  # partitioned over its edp group
            groups.append(moe.sharded_group(trainable, options[-1], cfg.zero_stage, bucket, compute, stage3,
                                            defer_master=on_disk, separate_master=separate, comm_dtypes=dtypes))
        elif stage3 is not None:
            groups.append(stage3.make_group(trainable, options[-1], dp_rank, _reduce_bucket(cfg, trainable, dp_size),
                                            defer_master=on_disk, separate_master=separate, comm_dtypes=dtypes))
        else:
            groups.append(ShardedGroup(trainable, options[-1], partitions, dp_rank,
                                       _reduce_bucket(cfg, trainable, dp_size), compute,
                                       defer_master=on_disk, separate_master=separate, master_dtype=master_dtype,
                                       alone=frozenset(i for i, p in enumerate(trainable) if id(p) in sparse),
                                       comm_dtypes=dtypes))
    offload = cfg.zero_optimization.offload_optimizer
    if offload.enabled:  # ZeRO-Offload: fp32 masters on host before the optimizer is built over them
        from ..offload import move_master_to_host

        for group in groups:
            if group is not None:
                # nvme parks the master on disk (its host copy is freed): pinning it would buy nothing
                move_master_to_host(group, offload.pin_memory and offload.device != "nvme")
    return groups, options


def build_base_optimizer(cfg: ZeroSpeedConfig, client: torch.optim.Optimizer | None,
                         groups: list[ShardedGroup | None], options: list[dict[str, Any]]) -> torch.optim.Optimizer | None:
    masters = [{**opts, "params": g.master_params if g is not None else []} for g, opts in zip(groups, options)]
    if client is not None:
        # Keep the client's object (schedulers built on it keep working): point its groups at the masters.
        for group, new in zip(client.param_groups, masters):
            group["params"] = new["params"]
        client.state.clear()
        return client
    if cfg.optimizer is None:
        return None
    from ..optim import build_optimizer

    return build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), masters)


def gradients_off_device(cfg: ZeroSpeedConfig, live: list[ShardedGroup]) -> bool:
    """Whether the reduced gradients bypass device partition buffers: nvme offload at stages 2-3 (to the swap
    files), cpu offload with the model on an accelerator (to host partitions)."""
    device = cfg.zero_optimization.offload_optimizer.device
    on_accelerator = any(g.device.type != "cpu" for g in live)
    partial = cfg.zero_optimization.offload_optimizer.ratio < 1.0  # the device share steps device gradients
    if cfg.zero_optimization.offload_optimizer.super_offload:  # its sink starts each sub-group's step
        return True
    return (device == "nvme" and cfg.zero_stage >= 2) or (device == "cpu" and on_accelerator and not partial)


def _local_accumulation(cfg: ZeroSpeedConfig, settings: ReduceSettings) -> ReduceSettings:
    """``zero_local_grad_accumulation`` (zerospeed only): stage 2 accumulates locally, reduces per boundary."""
    if cfg.zero_stage != 2 or settings.partition_sink:
        if cfg.zero_stage == 3 or settings.partition_sink:
            warnings.warn("zero_local_grad_accumulation has no effect here (it applies to ZeRO stage 2 with the "
                          "gradients in device memory; stages 0-1 always accumulate locally)")
        return settings
    return dataclasses.replace(settings, local_accumulation=True)


def _reduce_settings(cfg: ZeroSpeedConfig, base: Any, live: list[ShardedGroup], policy: Any,
                     dp_size: int) -> ReduceSettings:
    zcfg = cfg.zero_optimization
    overlap = True if zcfg.overlap_comm is None else zcfg.overlap_comm  # an explicit false is honoured
    settings = ReduceSettings(stage=cfg.zero_stage, dp_size=dp_size, accum_dtype=policy.accum, comm_dtype=policy.comm,
                              reduce_scatter=zcfg.reduce_scatter, overlap_comm=overlap,
                              prescale_gradients=cfg.prescale_gradients, average=cfg.gradient_allreduce_op == "mean",
                              gradient_predivide_factor=cfg.gradient_predivide_factor,
                              partition_sink=gradients_off_device(cfg, live), **topk(cfg, base))
    return _local_accumulation(cfg, settings) if cfg.zero_local_grad_accumulation else settings


def _stepper(cfg: ZeroSpeedConfig, base: Any, live: list[ShardedGroup], settings: ReduceSettings,
             dp_group: comm.Group | None, dp_rank: int, scaler: Any, state_dtype: torch.dtype = torch.float32) -> Any:
    """ZeRO-Offload's host stepper (ZenFlow's or SuperOffload's when set), or None without offload."""
    zcfg = cfg.zero_optimization
    if not zcfg.offload_optimizer.enabled:
        return None
    from ..offload import OffloadStepper

    stepper_args = (live, base, zcfg.offload_optimizer, cfg.aio, zcfg.sub_group_size, dp_group, dp_rank)
    if zcfg.offload_optimizer.super_offload:
        from ..offload.super_offload import SuperOffloadStepper

        return SuperOffloadStepper(*stepper_args, stream_grads=settings.partition_sink,
                                   speculate=cfg.gradient_clipping == 0, undoable=_may_skip(cfg, scaler),
                                   inv_scale=lambda: 1.0 / scaler.loss_scale)
    if zcfg.zenflow is not None:
        from ..offload.zenflow import ZenFlowStepper

        return ZenFlowStepper(*stepper_args, stream_grads=settings.partition_sink, zenflow=zcfg.zenflow)
    return OffloadStepper(*stepper_args, stream_grads=settings.partition_sink, state_dtype=state_dtype)


def _may_skip(cfg: ZeroSpeedConfig, scaler: Any) -> bool:
    """Whether the ZeRO optimizer checks for overflow, and so may skip a step (its ``check`` rule)."""
    check = cfg.fp16.enabled or (cfg.bf16.enabled and cfg.bf16.check_grad_overflow)
    return bool(check or scaler.dynamic or scaler.loss_scale != 1.0)


def build_zero_optimizer(cfg: ZeroSpeedConfig, base: torch.optim.Optimizer, live: list[ShardedGroup], stage3: Any,
                         policy: Any, dp_group: comm.Group | None, dp_size: int, dp_rank: int,
                         moe: Any = None, heap_trimmer: Any = None, names: dict[Any, str] | None = None,
                         norm_axes: NormAxes | None = None, sparse: frozenset[int] = frozenset()) -> ZeroOptimizer:
    if not live:
        raise ValueError("the model has no trainable parameters (every requires_grad is False)")
    check_zero_optimizer(cfg, base)
    zcfg = cfg.zero_optimization
    settings = _reduce_settings(cfg, base, live, policy, dp_size)
    scaler = LossScaler.from_config(cfg.fp16) if cfg.fp16.enabled else \
        GradScalerRule() if policy.uses_loss_scaling else NoScaler()  # fp16 torch_autocast
    stepper = _stepper(cfg, base, live, settings, dp_group, dp_rank, scaler, policy.states)
    compressor = compressor_for(settings, live, sparse)
    exchange = momentum_exchange_for(cfg.gradient_compression, any(g.num_partitions > 1 for g in live),
                                     cfg.gradient_clipping, moe is not None, dp_group)
    # the optimizer decides when the engine all-reduces gradients (a 1-bit optimizer; the top-k momentum exchange)
    gate = base.wants_backward_allreduce if getattr(base, "compresses_communication", False) else None  # type: ignore[attr-defined]
    if exchange is not None:
        gate = exchange.allreduce_gate(compressor)
    parts = reducer_parts(live, settings, None if stepper is None else stepper.sink, compressor,
                          zcfg.ignore_unused_parameters)
    wiring = ReducerWiring(sink=None if stepper is None else stepper.sink, heap_trimmer=heap_trimmer,
                           allreduce_gate=gate, names=dict(names or {}),
                           ignore_unused_parameters=zcfg.ignore_unused_parameters, parts=parts,
                           axes=None if moe is None else moe.shard_axes(live))  # experts: over their edp groups
    if stage3 is None:
        reducer = GradReducer(live, settings, dp_group, wiring)
    else:
        reducer = stage3.make_reducer(live, settings, wiring=wiring)
    if not zcfg.ignore_unused_parameters and cfg.zero_stage not in (1, 2):
        warnings.warn(f"zero_optimization.ignore_unused_parameters: false has no effect at ZeRO stage {cfg.zero_stage} "
                      "(as in DeepSpeed, it checks stages 1 and 2 only)")
    if zcfg.offload_optimizer.super_offload:  # its sink speculates on the reducer's boundary micro-step
        stepper.sink.follow(reducer)
    zero_opt = ZeroOptimizer(live, base, reducer, scaler, dp_group, cfg.gradient_clipping, policy.compute,
                             zcfg.allgather_bucket_size, stepper=stepper, allgather_partitions=zcfg.allgather_partitions,
                             check_grad_overflow=cfg.fp16.enabled or (cfg.bf16.enabled and cfg.bf16.check_grad_overflow),
                             norm_axes=norm_axes, momentum_exchange=exchange)
    return zero_opt


def build_scheduler(cfg: ZeroSpeedConfig, client: Any, opt: torch.optim.Optimizer | None) -> Any:
    if client is not None:
        return client(opt) if callable(client) and not hasattr(client, "step") else client
    if cfg.scheduler is None:
        return None
    from ..optim import build_scheduler as build

    return build(cfg.scheduler.type, dict(cfg.scheduler.params), opt)


def optimizer_stack(plan: TrainPlan, cfg: ZeroSpeedConfig, grids: Any, stage3: Any, policy: Any, model: nn.Module,
                    raw_groups: list[dict[str, Any]], client: Any, heap_trimmer: Any,
                    autocast: Any = None) -> tuple[ZeroOptimizer | None, Any]:
    """The ZeRO optimizer over the base optimizer (None without one), with the parallelisms' norm axes."""
    moe, dp_group = grids.moe, grids.dp_group
    sparse = sparse_parameters(cfg, model)
    groups, options = build_groups(cfg, raw_groups, stage3, policy.compute, grids.dp_size, grids.dp_rank, moe,
                                   policy.master, sparse, lower_precision_grads(cfg, autocast, model))
    live = [g for g in groups if g is not None]
    base = build_base_optimizer(cfg, client, groups, options)
    if base is None:
        return None, None
    names = {p: n for n, p in model.named_parameters()}
    zero_opt = build_zero_optimizer(cfg, base, live, stage3, policy, dp_group, grids.dp_size, grids.dp_rank, moe,
                                    heap_trimmer, names, norm_axes(plan, grids, model, live), sparse)
    if plan.compressing:  # a 1-bit optimizer averages its compressed momentum over the data-parallel group
        base.bind(dp_group)  # type: ignore[union-attr]
    return zero_opt, base


def lower_precision_grads(cfg: ZeroSpeedConfig, autocast: Any, model: nn.Module) -> dict[int, torch.dtype]:
    """``torch_autocast`` under ZeRO 1-3 (DeepSpeed's ``init_autocast_params`` and per-dtype IPG buckets): the
    parameters of the lower-precision-safe modules (exact classes: ``lower_precision_safe_modules``, default
    Linear and Conv1d/2d/3d) have their gradients reduced in the autocast dtype, the others in the
    communication dtype; accumulation stays in ``grad_accum_dtype``. Stage 0 reduces every gradient in the
    communication dtype (DeepSpeed's engine all-reduce reads no per-parameter dtype)."""
    if autocast is None or not autocast.enabled or cfg.zero_stage == 0 or autocast.dtype is None:
        return {}
    return {id(p): autocast.dtype for p in autocast.safe_parameters(model) if p.requires_grad}


def sparse_parameters(cfg: ZeroSpeedConfig, model: nn.Module) -> frozenset[int]:
    """``sparse_gradients``: the weights of the model's ``nn.Embedding`` / ``nn.EmbeddingBag`` (ids), reduced as
    rows; DeepSpeed honours it outside ZeRO only (stage 0), and so does zerospeed."""
    if not cfg.sparse_gradients:
        return frozenset()
    if cfg.zero_stage > 0:
        warnings.warn(f"sparse_gradients has no effect at ZeRO stage {cfg.zero_stage} (as in DeepSpeed, the "
                      "reduction of sparse gradients is stage 0's)")
        return frozenset()
    return frozenset(id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)))


def norm_axes(plan: TrainPlan, grids: Any, model: nn.Module, live: list[ShardedGroup]) -> NormAxes:
    """What pipeline, tensor and expert parallelism add to the one grad norm / overflow verdict."""
    shard_groups, split, tp_group = None, frozenset(), None
    if grids.moe is not None:  # experts' groups partitioned over their expert-data-parallel group
        shard_groups, split, tp_group = grids.moe.norm_axes_parts(live)
    if grids.tp is not None:  # the split model: split params' slices on every tensor rank
        split, tp_group = frozenset(grids.tp.split), grids.tp.tp_group
    pipe_group, replicated = None, frozenset()
    if plan.pipelined:  # the stages' layers; a tied weight counted on one stage
        pipe_group, replicated = grids.grid.get_pipe_parallel_group(), frozenset(model.replicated)
    return NormAxes.of(shard_groups, split, tp_group, replicated, pipe_group)
