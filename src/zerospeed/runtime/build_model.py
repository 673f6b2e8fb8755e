"""Assembly of the model: FP8 linears, placement (cast, move, rank 0's values; stage 3 cuts it) and the
optimizer's parameter groups."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .. import comm
from ..config import ZeroSpeedConfig
from .deepspeed_rules import note_offload_param_below_stage3
from .module_cast import cast_buffers, cast_parameters
from .plan import TrainPlan


def param_groups(module: nn.Module, model_parameters: Any, optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    """Normalise whatever the user passed into a list of {'params': [...], **options}."""
    if optimizer is not None:
        return [dict(g) for g in optimizer.param_groups]
    if model_parameters is None:
        return [{"params": list(module.parameters())}]
    items = list(model_parameters) if isinstance(model_parameters, Iterable) else [model_parameters]
    if items and isinstance(items[0], dict):
        return [{**g, "params": list(g["params"])} for g in items]
    return [{"params": items}]


def check_ownership(module: nn.Module, groups: list[dict[str, Any]]) -> None:
    owned = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    for gi, g in enumerate(groups):
        for p in g["params"]:
            if id(p) not in owned:
                raise ValueError(f"parameter group {gi} holds a tensor that is not a parameter of the model")
            if id(p) in seen:
                raise ValueError(f"a parameter appears in more than one parameter group (group {gi})")
            seen.add(id(p))


def muon_groups(cfg: ZeroSpeedConfig, model: nn.Module, raw_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DeepSpeed's Muon/Adam halves of each group, tagged by the layers' full shapes (optim/muon_groups.py)."""
    from ..optim.muon_groups import split_muon_groups, tag_use_muon
    from ..zero.stage3 import shard_of

    def full_shape(p: nn.Parameter) -> torch.Size:
        s = shard_of(p)
        return p.shape if s is None else s.shape

    tag_use_muon(model, full_shape)
    return split_muon_groups(raw_groups, dict(cfg.optimizer.params) if cfg.optimizer is not None else {})


def optimizer_groups(cfg: ZeroSpeedConfig, model: nn.Module, model_parameters: Any, optimizer: Any,
                     moe: Any) -> list[dict[str, Any]]:
    """The parameter groups the ZeRO groups are built from (Muon halves, MoE expert splits), checked."""
    raw = param_groups(model, model_parameters, optimizer)
    if optimizer is None and cfg.optimizer is not None and cfg.optimizer.type.lower() == "muon":
        raw = muon_groups(cfg, model, raw)
    if moe is not None:
        moe.sync_experts(model)
        raw = moe.split_groups(raw, from_client=optimizer is not None)
    check_ownership(model, raw)
    return raw


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
def sync_module(module: nn.Module, group: comm.Group | None) -> None:
    """Every rank starts from rank 0's parameters and buffers."""
    if comm.get_world_size(group) == 1:
        return
    src = comm.global_rank_of(group, 0)
    for t in [*module.parameters(), *module.buffers()]:
        if getattr(t, "allreduce", True) is False:  # an MoE expert's: synced within its expert-data group
            continue
        comm.broadcast(t.data, src=src, group=group)


def place_model(plan: TrainPlan, cfg: ZeroSpeedConfig, model: nn.Module, compute: torch.dtype,
                device: torch.device, dp_group: comm.Group | None, dp_rank: int, moe: Any = None) -> Any:
    """Cast and place the module and give every rank rank 0's values; under stage 3 also cut it (the
    stage-3 runtime is returned, else None)."""
    if cfg.zero_optimization.offload_param.enabled and plan.stage != 3:
        note_offload_param_below_stage3(plan.stage)  # accepted as DeepSpeed does, and said once in the log
    if plan.stage != 3:
        cast_parameters(model, device, compute)  # buffers keep their dtype (runtime/module_cast.py)
        cast_buffers(model, cfg.data_types, compute)
        sync_module(model, dp_group)
        return None
    from ..zero.stage3 import setup_stage3  # parameters partitioned too: cut them, install module hooks

    home = _param_home(cfg, model, compute, dp_rank) if plan.offload_param else None
    group_of = None if moe is None else moe.partition_groups(model)  # experts: over their expert-data group
    cast_buffers(model, cfg.data_types, compute)
    stage3 = setup_stage3(model, cfg.zero_optimization, compute, device, dp_group, home, group_of)
    if cfg.fp8.allgather_fp8:
        for shard in stage3.shards:
            shard.quantize_gather = "fp8"
    return stage3


def fp8_linears(cfg: ZeroSpeedConfig, model: nn.Module, device: torch.device) -> list[str]:
    """The ``fp8`` section: convert the linears (names returned)."""
    if not cfg.fp8.enabled:
        return []
    from ..precision.fp8 import convert_to_float8

    return convert_to_float8(model, cfg.fp8, device)
