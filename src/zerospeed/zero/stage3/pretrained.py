"""Loading pretrained weights into a ZeRO-3 model shard by shard: each rank reads only the elements it owns.

The model is built under ``zero.Init`` (already partitioned). For each parameter this rank reads from the
safetensors file(s) just the rows covering its owned flat range, and writes that range into its shard (or
the shard's offload home); persistent (whole) parameters and buffers are read whole. Called after
``initialize`` (any ZeRO stage), each written parameter's fp32 master elements are reloaded from its new value
(``fragments.reload_master``): the master is a separate tensor under parameter offload, optimizer offload and
16-bit compute, and it is what the next step and ``save_checkpoint`` read. A gathered value kept for reuse is
released first (the next gather brings the new one). No rank ever holds a
full copy of the model, and no collective runs (a ``quantized_initialization`` weight is read whole and
encoded: its packed bytes are cut, not its elements). A tensor missing from the files, an unexpected one (with
``strict``), or a shape mismatch is an error naming it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..fragments import reload_master
from .param_store import ParamShard, ShardState, shard_of


@dataclass
class LoadStats:
    elements_read: int = 0
    tensors: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, for a file, a directory with one, or a sharded index."""
    if os.path.isfile(path):
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return {k: path for k in f.keys()}
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return _files(single)
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _read_range(handle: Any, name: str, lo: int, hi: int) -> torch.Tensor:
    """Flat elements ``[lo, hi)`` of tensor ``name``, reading only the leading-dim rows that hold them."""
    sl = handle.get_slice(name)
    shape = sl.get_shape()
    if not shape:
        return sl[:].reshape(-1)[lo:hi]
    row = 1
    for d in shape[1:]:
        row *= d
    first, last = lo // row, (hi - 1) // row + 1
    rows = sl[first:last].reshape(-1)
    return rows[lo - first * row: hi - first * row]


def _settle(name: str, shard: ParamShard) -> None:
    """Before writing a cut shard: no gather in flight or gathered value may keep serving the old value."""
    if shard.state is ShardState.GATHERING and shard.pending is not None:
        shard.pending.finish()  # a prefetch started before the load
    if shard.holders:
        raise RuntimeError(f"{name}: cannot load pretrained weights into a ZeRO-3 parameter that is held gathered "
                           "(inside a forward, backward or GatheredParameters block); load outside it")
    shard.release()


@torch.no_grad()
def load_pretrained_shards(module: nn.Module, path: str, strict: bool = True) -> LoadStats:
    """Fill ``module`` (built under ``zero.Init``, or not partitioned at all) from safetensors at ``path``."""
    from safetensors import safe_open

    where = _files(path)
    stats = LoadStats()
    wanted: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]:
        if id(t) in seen and name not in where:
            continue  # a tied name the file does not store (lm_head.weight = wte.weight)
        seen.add(id(t))
        wanted[name] = t
    stats.missing = sorted(n for n in wanted if n not in where)
    stats.unexpected = sorted(n for n in where if n not in wanted)
    if stats.missing or (strict and stats.unexpected):
        raise KeyError(f"pretrained weights at {path} do not match the model: missing {stats.missing[:10]}, "
                       f"unexpected {stats.unexpected[:10]}")
    handles: dict[str, Any] = {}
    try:
        for name, t in wanted.items():
            fname = where[name]
            if fname not in handles:
                handles[fname] = safe_open(fname, "pt").__enter__()
            h = handles[fname]
            shard = shard_of(t)
            full_shape = tuple(shard.shape) if shard is not None else tuple(t.shape)
            file_shape = tuple(h.get_slice(name).get_shape())
            if file_shape != full_shape:
                raise ValueError(f"{name}: the file holds shape {file_shape}, the model {full_shape}")
            if shard is not None and not shard.persistent:
                _settle(name, shard)
            if shard is not None and shard.codec is not None:  # quantized_initialization: encode the whole value
                value = h.get_tensor(name)
                shard.write_full(value)
                stats.elements_read += value.numel()
            elif shard is None or shard.local is None:  # whole (not partitioned, or persistent)
                value = h.get_tensor(name)
                t.data.copy_(value.to(t.dtype))
                stats.elements_read += value.numel()
            else:
                lo, hi = shard.owned_range()
                values = torch.zeros(shard.shard, dtype=shard.dtype, device=shard.device)
                if hi > lo:
                    part = _read_range(h, name, lo, hi)
                    values[: hi - lo].copy_(part.to(shard.dtype))
                    stats.elements_read += part.numel()
                shard.write_local(values)
            reload_master(t)  # type: ignore[arg-type]  # after initialize: the optimizer's copy too
            stats.tensors += 1
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return stats
