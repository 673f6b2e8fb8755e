"""Checkpoint names of expert parameters by *global* expert id, so a checkpoint reshards to any ``ep_size``.

A rank's local expert ``l`` of an MoE layer is global expert ``ep_rank * E_local + l``. In a checkpoint
its parameters are named with the global id::

    <layer>.deepspeed_moe.experts.deepspeed_experts.<global id>.<param>

so ``ep=2`` (rank 1's local expert 0 is global expert 2) loads into ``ep=1`` (global expert 2 is local
expert 2) or ``ep=4``. At ``ep=1`` the names are the usual ``state_dict`` names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ... import comm

from .layer import MoE

_EXPERTS = "deepspeed_moe.experts.deepspeed_experts."


def _layers(module: nn.Module) -> list[tuple[str, MoE]]:
    layers = [(f"{n}." if n else "", m) for n, m in module.named_modules() if isinstance(m, MoE)]
    if any(m.deepspeed_moe.tp is not None for _, m in layers):
        raise NotImplementedError("checkpoints of tensor-parallel experts (enable_expert_tensor_parallelism with a "
                                  "tensor-parallel mpu) are not supported yet by zerospeed")
    return layers


def _split(key: str, layers: list[tuple[str, MoE]]) -> tuple[str, MoE, int, str] | None:
    """(layer prefix + experts path, layer, local id, rest) when ``key`` names a local expert's tensor."""
    for prefix, layer in layers:
        head = prefix + _EXPERTS
        if key.startswith(head):
            local, _, rest = key[len(head):].partition(".")
            return head, layer, int(local), rest
    return None


def rename(pairs: Iterable[tuple[str, torch.Tensor]], module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` with local expert ids replaced by global ones."""
    layers = _layers(module)
    for key, t in pairs:
        hit = _split(key, layers) if layers else None
        if hit is None:
            yield key, t
        else:
            head, layer, local, rest = hit
            yield f"{head}{layer.global_expert_ids()[local]}.{rest}", t


def global_param_names(module: nn.Module) -> dict[int, str]:
    """``id(param) -> checkpoint name`` (experts by global id)."""
    return {id(p): name for name, p in rename(module.named_parameters(), module)}


def other_expert_keys(pairs: Iterable[tuple[str, torch.Tensor]], module: nn.Module) -> list[tuple[str, str]]:
    """``(key of an expert held by another rank, key of this rank's first expert tensor with its shape)``;
    ``pairs`` are already renamed (global ids)."""
    layers = _layers(module)
    out = []
    for key, _ in pairs:
        hit = _split(key, layers) if layers else None
        if hit is None:
            continue
        head, layer, gid, rest = hit
        mine = layer.global_expert_ids()
        if gid == mine[0]:
            out += [(f"{head}{g}.{rest}", key) for g in range(layer.num_experts) if g not in mine]
    return out


def expert_writers(pairs: Iterable[tuple[str, torch.Tensor]], module: nn.Module) -> dict[str, bool]:
    """``renamed key of this rank's expert tensor -> whether this rank writes it`` (its expert-data-parallel
    group's first rank does: the ranks of that group hold the same experts); ``pairs`` already renamed."""
    layers = _layers(module)
    out: dict[str, bool] = {}
    for key, _ in pairs:
        hit = _split(key, layers) if layers else None
        if hit is not None:
            eg = hit[1].expert_groups
            out[key] = eg is None or not comm.is_initialized() or eg.edp_ranks[0] == comm.get_rank()
    return out


@torch.no_grad()
def with_all_experts(state: dict[str, torch.Tensor], module: nn.Module, group: object) -> dict[str, torch.Tensor]:
    """``state`` (rank 0's ``full_state_dict``) with every expert of every layer under its global id, as an
    ``ep=1`` model names it. Collective over ``group`` (the data-parallel group): the first rank of each
    expert-data-parallel group sends its experts' full values (gathered first under ZeRO-3)."""
    from ...zero.stage3 import GatheredParameters

    state = _with_grouped_experts(state, module, group)
    layers = _layers(module)
    mine = [(k, t) for k, t in rename(module.named_parameters(), module) if _split(k, layers) is not None]
    writes = expert_writers(mine, module)
    with GatheredParameters([t for _, t in mine]):
        values = {k: t.detach().cpu().clone() for k, t in mine if writes[k]}
    gathered = comm.all_gather_object(values, group=group) if comm.is_initialized() else [values]
    if state:  # rank 0: drop the local names, add every expert by global id
        local = {k for k in state for head in (p + _EXPERTS for p, _ in layers) if k.startswith(head)}
        state = {k: v for k, v in state.items() if k not in local}
        for part in gathered:
            state.update(part)
    return state


@torch.no_grad()
def _with_grouped_experts(state: dict[str, torch.Tensor], module: nn.Module, group: object) -> dict[str, torch.Tensor]:
    """``state`` with each AutoEP expert weight whole (all experts, HF's shape): the first rank of every
    expert-data-parallel group sends its slice; rank 0 puts the slices in global expert order. Collective."""
    from ...zero.stage3 import GatheredParameters
    from .auto.layer import AutoEPExperts, expert_slice

    layers = [(f"{n}." if n else "", m) for n, m in module.named_modules() if isinstance(m, AutoEPExperts)]
    if not layers:
        return state
    mine: dict[str, tuple[int, torch.Tensor]] = {}
    for prefix, layer in layers:
        eg = layer.expert_groups
        writes = eg is None or not comm.is_initialized() or eg.edp_ranks[0] == comm.get_rank()
        params = [(prefix + n, getattr(layer, n)) for n in layer.weight_names]
        with GatheredParameters([p for _, p in params]):
            for name, p in params:
                if writes:
                    mine[name] = (expert_slice(p).offset if expert_slice(p) else 0, p.detach().cpu().clone())
    parts = comm.all_gather_object(mine, group=group) if comm.is_initialized() else [mine]
    if state:  # rank 0
        for name in mine:
            pieces = sorted({part[name][0]: part[name][1] for part in parts if name in part}.items())
            state[name] = torch.cat([t for _, t in pieces])
    return state
