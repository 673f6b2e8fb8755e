"""Export of a partitioned model: its full state dict on rank 0, and a 16-bit safetensors file.

``full_state_dict`` walks the modules in order and gathers each one's parameters (one collective per
module, released right after), copying them to CPU on rank 0, so no rank ever holds more than one
module's full parameters on the device. With ``fp32=True`` and the ZeRO optimizer, trainable
parameters come from the fp32 master shards instead (gathered bucket by bucket), i.e. without the
rounding to the compute dtype. Keys are those of ``module.state_dict()`` (tied parameters under every
name, persistent buffers included). Works for unpartitioned models too (stages 0-2).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ... import comm
from ..layout import gather_from
from .gathered import GatheredParameters


def state_entries(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(state_dict key, tensor)`` for parameters and persistent buffers, tied ones under every name."""
    for mname, m in module.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for k, p in m._parameters.items():
            if p is not None:
                yield prefix + k, p
        for k, b in m._buffers.items():
            if b is not None and k not in m._non_persistent_buffers_set:
                yield prefix + k, b


@torch.no_grad()
def _master_values(optimizer: Any, group: comm.Group | None, keep: bool) -> dict[int, torch.Tensor]:
    """Full fp32 values of every trainable parameter, from the optimizer's master shards (collective)."""
    out: dict[int, torch.Tensor] = {}
    for grp in getattr(optimizer, "groups", []):
        if grp.master is None:
            if keep:
                out.update({id(p): p.detach().float().cpu().clone() for p in grp.params})
            continue
        n = grp.num_partitions
        for bucket in grp.plan.buckets:
            send = grp.master_range(bucket.partition_offset, bucket.partition_offset + bucket.shard_numel)
            if n == 1:  # not partitioned (stage 0 with a separate master): this rank holds it whole
                buf = send.to(torch.float32)
            else:
                buf = torch.empty(n * bucket.shard_numel, dtype=torch.float32, device=send.device)
                comm.all_gather(buf, send, group=group)
            buf2d = buf.view(n, bucket.shard_numel)
            for i in bucket.params:
                slot = grp.plan.slots[i]
                if keep:
                    full = torch.empty(slot.numel, dtype=torch.float32, device=send.device)
                    gather_from(buf2d, slot.offset, slot.shard, full)
                    out[id(grp.params[i])] = full.view(grp.full_shape(i)).cpu()
    return out


@torch.no_grad()
def full_state_dict(module: nn.Module, optimizer: Any = None, fp32: bool = False, rank0_only: bool = True,
                    group: comm.Group | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU (every rank must call; others get ``{}`` when ``rank0_only``)."""
    keep = not rank0_only or comm.get_rank(group) == 0
    masters = _master_values(optimizer, group, keep) if fp32 and optimizer is not None else {}
    values: dict[int, torch.Tensor] = {}
    for m in module.modules():
        direct = [p for p in m._parameters.values() if p is not None and id(p) not in values]
        with GatheredParameters(direct):
            for p in direct:
                if id(p) in masters:
                    values[id(p)] = masters[id(p)]
                else:
                    t = p.detach()
                    values[id(p)] = (t.float() if fp32 and t.is_floating_point() else t).cpu().clone() if keep else t[:0]
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state_entries(module):
        v = values.get(id(t))
        if v is None:  # a buffer
            v = t.detach().cpu().clone()
            if fp32 and v.is_floating_point():
                v = v.float()
        out[name] = v
    return out


def save_safetensors(state: dict[str, torch.Tensor], path: str) -> None:
    """Write atomically (temporary file, then rename); tied tensors are written under each name."""
    from safetensors.torch import save_file

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        save_file({k: v.contiguous().clone() for k, v in state.items()}, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_16bit_model(module: nn.Module, save_dir: str, save_filename: str = "model.safetensors",
                     group: comm.Group | None = None, exclude_frozen_parameters: bool = False) -> bool:
    """Gather the model in its compute dtype and write it on rank 0 as safetensors; True on rank 0.
    ``exclude_frozen_parameters`` leaves out parameters with ``requires_grad=False`` (e.g. a LoRA base model)."""
    state = full_state_dict(module, rank0_only=True, group=group)
    if exclude_frozen_parameters:
        frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    if comm.get_rank(group) != 0:
        return False
    save_safetensors(state, os.path.join(save_dir, save_filename))
    return True
