"""ZeRO++ qgZ (``zero_quantized_gradients``): a stage-3 bucket's gradients reduce-scattered as int4.

A bucket's buffer is ``[N, S]`` (rank-major; each parameter a column block ``[offset, offset + shard)``,
``zero/partition.py``). Per parameter, as DeepSpeed's ``all_to_all_quant_reduce`` decides per tensor:

* a parameter of two or more dimensions whose size is divisible by ``2 * N`` goes through
  ``comm.quantized_reduce_scatter`` (int4, intra- then inter-node all-to-all); its quantisation block is
  ``numel / max(shape[0], shape[1], N)`` elements (DeepSpeed's ``intra_quant_group`` groups), rounded up
  to an even size, the column block zero-padded to a whole number of blocks;
* 1-D parameters (biases, norms) and indivisible ones (DeepSpeed warns and falls back) are reduced
  exactly: all their columns of the bucket in one plain reduce-scatter.

With a single node (``ranks_per_node`` = world) DeepSpeed does not quantise: plain reduce-scatter.

LoCo (``zeropp_loco_param: {"err_beta", "reset_T"}``): each quantised column block keeps two fp32 error
buffers (``comm/quantized_grads.py``: one per level) between reductions; they start from zero, and again
after ``reset_T`` reductions of that block. (DeepSpeed stores them as int8 between steps and counts the
reductions globally; here each block counts its own, at fp32.)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ... import comm
from ..sharded_group import ShardedGroup

_log = logging.getLogger("zerospeed.zero")


@dataclass(frozen=True)
class QuantizedColumns:
    """One parameter's column block of a bucket, reduced as int4 in blocks of ``block`` elements."""

    offset: int
    shard: int
    block: int

    @property
    def padded(self) -> int:
        return -(-self.shard // self.block) * self.block


def quant_block(shape: torch.Size, world: int, shard: int) -> int:
    """Elements per int4 block: ``numel / max(shape[0], shape[1], world)``, at most ``shard``, even."""
    per_row = math.ceil(max(shape[0], shape[1], world) / world)  # DeepSpeed's groups per partition
    block = -(-shard // per_row)
    return block + block % 2


def plan_bucket(shapes: list[torch.Size], offsets: list[int], shard: list[int], world: int,
                width: int) -> tuple[list[QuantizedColumns], list[int]]:
    """(quantised column blocks, the bucket's other columns) for parameters of ``shapes`` (pure)."""
    quantized, covered = [], set()
    for shape, off, s in zip(shapes, offsets, shard):
        numel = math.prod(shape)
        if len(shape) < 2:
            continue
        if numel % (2 * world):
            _log.warning("qgZ falls back to reduce_scatter for a parameter of shape %s: its size %d is not "
                         "divisible by 2 * world size (%d)", tuple(shape), numel, 2 * world)
            continue
        quantized.append(QuantizedColumns(off, s, quant_block(shape, world, s)))
        covered.update(range(off, off + s))
    return quantized, [c for c in range(width) if c not in covered]


@dataclass(frozen=True)
class LocoParams:
    """``zeropp_loco_param``: error moving-average coefficient and reset period (DeepSpeed's defaults)."""

    err_beta: float = 0.8
    reset_T: int = 1024


class QuantizedGradients:
    """The stage-3 reducer's reduce-scatter under qgZ (one plan per bucket, made on first use)."""

    def __init__(self, hierarchy: comm.Hierarchy, dp_group: comm.Group | None, loco: LocoParams | None = None) -> None:
        self.h = hierarchy
        self.dp_group = dp_group
        self.plans: dict[tuple[int, int], tuple[list[QuantizedColumns], torch.Tensor | None]] = {}
        self.loco = loco
        # LoCo: per (group, bucket, column offset): (intra error, inter error, reductions since the last reset)
        self.errors: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}

    def _errors(self, key: tuple[int, int, int], n: int, padded: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.loco is None:
            return None
        held = self.errors.get(key)
        if held is None or held[2] >= self.loco.reset_T:
            held = (torch.zeros(n * padded, device=device), torch.zeros(self.h.layout.nodes * padded, device=device), 0)
        self.errors[key] = (held[0], held[1], held[2] + 1)
        return held[0], held[1]

    def _plan(self, g: int, grp: ShardedGroup, b: int) -> tuple[list[QuantizedColumns], torch.Tensor | None]:
        if (g, b) not in self.plans:
            bucket = grp.plan.buckets[b]
            slots = [grp.plan.slots[i] for i in bucket.params]
            quantized, plain = plan_bucket([grp.full_shape(i) for i in bucket.params], [s.offset for s in slots],
                                           [s.shard for s in slots], grp.num_partitions, bucket.shard_numel)
            self.plans[(g, b)] = (quantized, torch.tensor(plain, dtype=torch.long) if plain else None)
        return self.plans[(g, b)]

    @torch.no_grad()
    def reduce_scatter(self, g: int, grp: ShardedGroup, b: int, send: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the sum over ranks of bucket ``b``'s buffer ``send`` (``[N * S]``)."""
        n, width = grp.num_partitions, grp.plan.buckets[b].shard_numel
        out = torch.empty(width, dtype=send.dtype, device=send.device)
        rows = send.view(n, width)
        quantized, plain = self._plan(g, grp, b)
        for q in quantized:
            buf = torch.zeros(n, q.padded, dtype=send.dtype, device=send.device)
            buf[:, : q.shard].copy_(rows[:, q.offset: q.offset + q.shard])
            mine = torch.empty(q.padded, dtype=send.dtype, device=send.device)
            errors = self._errors((g, b, q.offset), n, q.padded, send.device)
            comm.quantized_reduce_scatter(mine, buf.reshape(-1), self.h, q.block, errors,
                                          self.loco.err_beta if self.loco is not None else 0.0)
            out[q.offset: q.offset + q.shard].copy_(mine[: q.shard])
        if plain is not None:
            idx = plain.to(send.device)
            mine = torch.empty(idx.numel(), dtype=send.dtype, device=send.device)
            comm.reduce_scatter(mine, rows.index_select(1, idx).reshape(-1), group=self.dp_group)
            out[idx] = mine
        return out
