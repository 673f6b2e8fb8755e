"""Tensor-parallel inference: every rank holds 1/tp of each attention and MLP matrix (Megatron's cut).

Per block (the adapter's ``tp_plan``): the query/key/value projection is column-parallel, cut on key/value
head groups (a fused QKV weight is cut per sub-matrix, ``FusedQKVLinear``), so each rank owns whole heads
and attends over its own heads only, with its own KV cache of ``kv_heads / tp`` heads; the attention output
projection is row-parallel (partial sums all-reduced over the group); the MLP's first projection(s) are
column-parallel and its last one row-parallel. So a block costs two all-reduces of ``[tokens, hidden]``
per forward. Embeddings, norms and the LM head stay whole on every rank, so every rank computes the same
logits and picks the same tokens (no broadcast needed). The layers are ``zerospeed.parallel.tensor``'s
(DeepSpeed's ``LinearLayer`` / ``LinearAllreduce`` and shard-size rules, ``tp_grain_size`` included).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zerospeed import comm
from zerospeed.parallel.tensor import AutoTPMeta, FusedQKVLinear, LinearAllreduce, LinearLayer, split_heads

from .adapters import DecoderAdapter

__all__ = ["shard_for_inference"]


def _parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, leaf = path.split(".")
    for name in parents:
        root = getattr(root, name)
    return root, leaf


def shard_for_inference(adapter: DecoderAdapter, group: Any, tp_grain_size: int = 64) -> int:
    """Cut ``adapter``'s model in place over ``group``; set the adapter's local head counts. Returns layers cut."""
    tp, rank = comm.get_world_size(group), comm.get_rank(group)
    meta = AutoTPMeta(num_kv_heads=adapter.num_kv_heads, num_attention_heads=adapter.num_heads,
                      tp_grain_size=tp_grain_size)
    heads = split_heads(adapter.num_heads, adapter.num_kv_heads, tp)
    cut = 0
    for i, block in enumerate(adapter.blocks()):
        for path, kind in adapter.tp_plan():
            parent, leaf = _parent(block, path)
            module, name = getattr(parent, leaf), f"layers.{i}.{path}"
            if kind == "qkv":
                new: nn.Module = FusedQKVLinear(module, group, adapter.num_heads, adapter.num_kv_heads, name=name,
                                                tp_meta=meta)
            elif kind == "column":
                new = LinearLayer(module, group, name=name, tp_meta=meta)
            else:
                new = LinearAllreduce(module, group, name=name, tp_meta=meta)
            setattr(parent, leaf, new)
            cut += 1
    adapter.num_heads, adapter.num_kv_heads = heads[rank]
    return cut


def resolve_tp_group(tp: int, group: Any, how_to_start: str) -> Any:
    """The group of ``tp`` ranks: ``group`` when given, else the world when it has exactly ``tp`` ranks."""
    if not comm.is_initialized():
        raise ValueError(f"tensor_parallel.tp_size={tp} needs the process group first: {how_to_start}")
    if group is None:
        if comm.get_world_size() != tp:
            raise ValueError(f"tensor_parallel.tp_size={tp} but the world has {comm.get_world_size()} ranks; pass "
                             "tensor_parallel.tp_group (or an mpu) for a group of tp_size ranks")
        group = comm.world_group()
    if comm.get_world_size(group) != tp:
        raise ValueError(f"tensor_parallel.tp_group has {comm.get_world_size(group)} ranks, tp_size is {tp}")
    return group
