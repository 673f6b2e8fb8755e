"""DeepSpeed's ``safe_get/set_full_*`` and ``safe_get/set_local_*`` helpers: one parameter's fp32 master,
optimizer state or reduced gradient, whatever ZeRO stage partitioned it.

The engine binds every optimizer parameter to its place (group, slot) once; the helpers read the rank's
shard of that slot and, for the ``full`` variants, all-gather the shards over the group the parameter is
partitioned on. So the full variants are collective: every rank of that group must call them, in the same
order, as in DeepSpeed. A parameter no optimizer owns (frozen) gives ``None``, as in DeepSpeed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .. import comm
from ..config import NotSupportedYetError
from .sharded_group import ShardedGroup

_ATTR = "_zerospeed_fragment"


class Fragment:
    """Where parameter ``index`` of ``group`` lives inside ``optimizer`` (a ``ZeroOptimizer``).

    Held by the parameter, so it refers to the optimizer and group weakly: no reference cycle keeps an engine
    (and its offload swap files) alive after the user drops it."""

    def __init__(self, optimizer: Any, group: ShardedGroup, index: int) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._group = weakref.ref(group)
        self.index = index

    @property
    def optimizer(self) -> Any:
        opt = self._optimizer()
        if opt is None:
            raise RuntimeError("the engine that owned this parameter no longer exists")
        return opt

    @property
    def group(self) -> ShardedGroup:
        grp = self._group()
        if grp is None:
            raise RuntimeError("the engine that owned this parameter no longer exists")
        return grp

    @property
    def numel(self) -> int:
        return self.group.plan.slots[self.index].numel

    @property
    def shape(self) -> torch.Size:
        return self.group.full_shape(self.index)

    @property
    def owned(self) -> tuple[int, int]:
        return self.group.plan.slots[self.index].owned_range(self.group.rank)

    @property
    def master_param(self) -> nn.Parameter:
        return self.group.master_params[self.index]


def bind(optimizer: Any) -> None:
    """Record on each parameter of a ``ZeroOptimizer`` where its master shard lives."""
    for grp in optimizer.groups:
        for i, p in enumerate(grp.params):
            setattr(p, _ATTR, Fragment(optimizer, grp, i))


def fragment_of(param: nn.Parameter) -> Fragment | None:
    return getattr(param, _ATTR, None)


def reload_master(param: nn.Parameter) -> None:
    """``param``'s model value was replaced outside training (pretrained weights loaded after ``initialize``):
    reload this rank's master elements from it, so that the next step and ``save_checkpoint`` see the new
    value. No collective; nothing to do for a parameter no optimizer owns or one that is its own master."""
    fr = fragment_of(param)
    if fr is not None:
        fr.group.refresh_master(fr.index)


# --- shard <-> full ------------------------------------------------------------------------------
def _local(fr: Fragment, flat_shard: torch.Tensor) -> torch.Tensor:
    """This rank's owned elements out of a slot-sized flat shard (or the whole flat parameter)."""
    lo, hi = fr.owned
    return flat_shard.reshape(-1)[: hi - lo]


def _gather(fr: Fragment, shard: torch.Tensor) -> torch.Tensor:
    """The full tensor from every rank's slot-sized shard (collective when the group is partitioned)."""
    grp = fr.group
    if grp.num_partitions == 1:
        return shard.reshape(fr.shape).clone()
    slot = grp.plan.slots[fr.index]
    send = torch.zeros(slot.shard, dtype=shard.dtype, device=comm.device_for_backend(fr.optimizer.dp_group))
    lo, hi = fr.owned
    send[: hi - lo].copy_(shard.reshape(-1)[: hi - lo])
    out = torch.empty(slot.shard * grp.num_partitions, dtype=send.dtype, device=send.device)
    comm.all_gather(out, send, group=fr.optimizer.gather_group(grp))
    return out[: fr.numel].view(fr.shape).to(shard.device)


def _master_shard(fr: Fragment) -> torch.Tensor:
    grp = fr.group
    if grp.alias:
        return grp.params[fr.index].detach().reshape(-1)
    start, _ = grp.slot_range(fr.index)
    lo, hi = fr.owned
    length = fr.numel if grp.num_partitions == 1 else hi - lo
    return grp.master_range(start, start + length)


def _write_master(fr: Fragment, full_or_local: torch.Tensor, is_full: bool) -> None:
    grp = fr.group
    lo, hi = fr.owned
    flat = full_or_local.detach().reshape(-1).to(torch.float32)
    own = flat[lo:hi] if is_full and grp.num_partitions > 1 else flat[: hi - lo] if grp.num_partitions > 1 else flat
    if grp.alias:
        grp.params[fr.index].data.view(-1).copy_(own)
        return
    start, _ = grp.slot_range(fr.index)
    grp.write_master_range(start, own.to(grp.device if grp.master_home is None else "cpu"))
    if grp.num_partitions == 1 or grp.params_sharded:
        grp.copy_master_to_params()  # the model sees the new value at once (no communication)
    elif is_full:
        grp.params[fr.index].data.copy_(flat.view(fr.shape).to(grp.params[fr.index].dtype))


def _state(fr: Fragment, key: str) -> torch.Tensor:
    if fr.optimizer.stepper is not None:
        raise NotSupportedYetError("offload_optimizer", "safe_get/set_*_optimizer_state with an offloaded optimizer "
                                   "is not supported yet by zerospeed (read it from a checkpoint instead)")
    state = fr.optimizer.optimizer.state.get(fr.master_param, {})
    if key not in state:
        raise KeyError(f"optimizer state {key!r} not found; this parameter has {sorted(state)}")
    return state[key]


def _grad_slice(fr: Fragment, what: str) -> torch.Tensor:
    """This rank's elements of the reduced gradient, as a view of the reducer's partition (loss-scaled)."""
    opt = fr.optimizer
    if getattr(opt.reducer, "sink", None) is not None:
        raise NotSupportedYetError("offload_optimizer", f"{what} with offloaded gradients is not "
                                   "supported yet by zerospeed")
    gi = opt.groups.index(fr.group)
    part = opt.reducer.partition_buffer(gi)
    start, _ = fr.group.slot_range(fr.index)
    lo, hi = fr.owned
    length = fr.numel if fr.group.num_partitions == 1 else hi - lo
    return part[start:start + length]


def _grad_shard(fr: Fragment) -> torch.Tensor | None:
    return _grad_slice(fr, "safe_get_full_grad").float() / fr.optimizer.loss_scaler.loss_scale


def _write_grad(fr: Fragment, own: torch.Tensor) -> None:
    """Overwrite this rank's reduced-gradient elements with ``own`` (unscaled; the loss scale is applied)."""
    target = _grad_slice(fr, "safe_set_*_grad")
    scaled = own.detach().reshape(-1).to(torch.float32) * fr.optimizer.loss_scaler.loss_scale
    target.copy_(scaled[: target.numel()].to(target.dtype))


# --- DeepSpeed's public helpers ---------------------------------------------------------------------
def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (collective over its group); None when no optimizer owns it."""
    fr = fragment_of(param)
    return None if fr is None else _gather(fr, _master_shard(fr))


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite ``param``'s fp32 master (and its model copy) with the whole tensor ``value`` (no collective:
    every rank keeps its own elements of ``value``)."""
    fr = fragment_of(param)
    if fr is not None:
        _check_shape(fr, value)
        _write_master(fr, value, is_full=True)


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` (e.g. ``exp_avg``) of ``param`` (collective)."""
    fr = fragment_of(param)
    if fr is None:
        return None
    t = _state(fr, optim_state_key)
    if t.dim() == 0 or t.numel() == 1 and fr.numel != 1:
        return t.clone()
    return _gather(fr, t)


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    fr = fragment_of(param)
    if fr is None:
        return
    t = _state(fr, optim_state_key)
    _check_shape(fr, value)
    lo, hi = fr.owned
    flat = value.detach().reshape(-1).to(t.dtype)
    own = flat[lo:hi] if fr.group.num_partitions > 1 else flat
    t.view(-1)[: own.numel()].copy_(own.to(t.device))


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The reduced (data-parallel averaged, unscaled) gradient of ``param`` between the boundary backward
    and ``step()`` (collective); ``param.grad`` when the module holds one, as in DeepSpeed."""
    if param.grad is not None:
        return param.grad
    fr = fragment_of(param)
    if fr is None:
        return None
    shard = _grad_shard(fr)
    return None if shard is None else _gather(fr, shard)


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of ``param``'s fp32 master (flat; the whole parameter when not partitioned)."""
    fr = fragment_of(param)
    return None if fr is None else _master_shard(fr).clone()


def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    fr = fragment_of(param)
    if fr is not None:
        _write_master(fr, value, is_full=False)


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    fr = fragment_of(param)
    if fr is None:
        return None
    t = _state(fr, optim_state_key)
    return t.clone() if t.dim() == 0 else _local(fr, t).clone() if fr.group.num_partitions > 1 else t.clone()


def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    fr = fragment_of(param)
    if fr is None:
        return
    t = _state(fr, optim_state_key)
    src = value.detach().reshape(-1).to(t.dtype)
    t.view(-1)[: src.numel()].copy_(src.to(t.device))


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    if param.grad is not None:
        return param.grad
    fr = fragment_of(param)
    return None if fr is None else _grad_shard(fr)


def _set_grad(param: nn.Parameter, value: torch.Tensor, is_full: bool) -> None:
    """``param.grad`` when the module holds one (as in DeepSpeed), else this rank's reduced-gradient elements."""
    if param.grad is not None:
        param.grad.copy_(value.to(param.grad.dtype))
        return
    fr = fragment_of(param)
    if fr is None:
        return
    flat = value.reshape(-1)
    if is_full:
        _check_shape(fr, value)
        lo, hi = fr.owned
        flat = flat[lo:hi] if fr.group.num_partitions > 1 else flat
    _write_grad(fr, flat)


def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Replace ``param``'s reduced gradient (between the boundary backward and ``step()``) with the whole
    tensor ``value``; each rank keeps its own elements (no collective)."""
    _set_grad(param, value, is_full=True)


def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's elements of ``param``'s reduced gradient (the shape ``safe_get_local_grad`` gives)."""
    _set_grad(param, value, is_full=False)


def _check_shape(fr: Fragment, value: torch.Tensor) -> None:
    if value.numel() != fr.numel:
        raise ValueError(f"value has {value.numel()} elements (shape {tuple(value.shape)}); the parameter has "
                         f"{fr.numel} (shape {tuple(fr.shape)})")


__all__ = [
    "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
    "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_get_local_fp32_param", "safe_set_local_fp32_param",
    "safe_get_local_optimizer_state", "safe_set_local_optimizer_state", "safe_get_local_grad", "safe_set_full_grad",
    "safe_set_local_grad",
]
