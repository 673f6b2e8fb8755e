"""``deepspeed.runtime.comm.coalesced_collectives.reduce_scatter_coalesced``: average a list of tensors over
``group`` and keep this rank's ZeRO partition of each, with one reduce-scatter for the whole list.

Each tensor is cut as ZeRO cuts a parameter (``zero/partition.py``'s ``shard_size``: chunks of
``ceil(numel / world)``, the last ones shorter or empty); the send buffer holds, for every rank in turn,
that rank's chunk of every tensor (zero-padded to the chunk size), so zerospeed's ``comm.reduce_scatter``
hands each rank its chunks in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import comm
from ..zero.partition import shard_size


def reduce_scatter_coalesced(tensors: Sequence[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """This rank's partition of the average of each tensor over ``group`` (collective)."""
    world = comm.get_world_size(group)
    rank = comm.get_rank(group)
    sizes = [shard_size(t.numel(), world) for t in tensors]
    width = sum(sizes)
    dtype, device = tensors[0].dtype, tensors[0].device
    send = torch.zeros(world * width, dtype=dtype, device=device)
    offset = 0
    for t, s in zip(tensors, sizes):
        flat = t.detach().reshape(-1)
        for r in range(world):
            piece = flat[r * s:(r + 1) * s]
            send[r * width + offset: r * width + offset + piece.numel()].copy_(piece)
        offset += s
    mine = torch.empty(width, dtype=dtype, device=device)
    comm.reduce_scatter(mine, send, group=group, scratch=True)
    mine.div_(world)
    out, offset = [], 0
    for t, s in zip(tensors, sizes):
        length = max(0, min(s, t.numel() - rank * s))
        out.append(mine[offset: offset + length])
        offset += s
    return out


def all_to_all_quant_reduce(tensors: Sequence[torch.Tensor], groups: Any) -> list[torch.Tensor]:
    """DeepSpeed's qgZ kernel path: not served; zerospeed's qgZ runs inside stage 3."""
    raise NotImplementedError("all_to_all_quant_reduce is not served by zerospeed: ZeRO++ qgZ is the config key "
                              "zero_optimization.zero_quantized_gradients (comm.quantized_reduce_scatter)")


__all__ = ["all_to_all_quant_reduce", "reduce_scatter_coalesced"]
