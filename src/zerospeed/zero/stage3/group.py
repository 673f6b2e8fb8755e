"""Stage 3's optimizer group and gradient reducer: stage 2's, with the parameters themselves partitioned.

The partition plan is the same (shard ``s = ceil(n/N)``, rank ``r`` owns ``[r*s, (r+1)*s)``), so a
parameter's master slot and its compute-dtype local shard cover the same elements: after the optimizer
step the write-back is a local copy, master slot -> shard. Persistent (whole) parameters are updated by
one all-gather of their master slots per group. Gradients go through the stage-2 reducer; once a
parameter's gradient is taken, its module may release the parameter (``Fetcher.on_grad``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ... import comm
from ..grad_reducer import GradReducer, ReduceSettings, ReducerWiring
from ..layout import gather_from
from ..sharded_group import ShardedGroup
from .fetcher import Fetcher
from .param_store import ParamShard, shard_of
from .qgz import QuantizedGradients


def _shards(params: list[nn.Parameter]) -> list[ParamShard]:
    out = []
    for p in params:
        s = shard_of(p)
        if s is None:
            raise RuntimeError("stage-3 group built over a parameter that was not partitioned")
        out.append(s)
    return out


class Stage3Group(ShardedGroup):
    params_sharded = True
    # MiCS: the ranks holding the same partition (one per shard group); None when partitioned over all ranks
    replica_group: comm.Group | None = None

    def __init__(self, params: list[nn.Parameter], options: dict[str, Any], num_partitions: int, rank: int,
                 bucket_numel: int, compute_dtype: torch.dtype, dp_group: comm.Group | None,
                 defer_master: bool = False, separate_master: bool = False,
                 comm_dtypes: Sequence[torch.dtype | None] | None = None) -> None:
        self.shards = _shards(params)
        self.dp_group = dp_group
        super().__init__(params, options, num_partitions, rank, bucket_numel, compute_dtype,
                         device=self.shards[0].device if self.shards else None, defer_master=defer_master,
                         separate_master=separate_master, comm_dtypes=comm_dtypes)
        for i, s in enumerate(self.shards):
            s.on_modified.append(lambda i=i: self.refresh_master(i))
        self._alias_fp32_shards()

    def _alias_fp32_shards(self) -> None:
        """fp32 compute: a cut parameter's local shard becomes its master slot (one tensor, not two).

        Stage 3 then holds 16 bytes per parameter / N in fp32 (shard-master 4 + Adam 8 + gradient 4),
        as DeepSpeed does; the write-back after the step has nothing left to copy for these shards.
        """
        if self.master is None or self.master_deferred:  # a deferred master lives on disk: nothing to share
            return
        for i, s in enumerate(self.shards):
            if s.local is not None and s.home is None and s.local.dtype == torch.float32 \
                    and s.local.device == self.master.device:
                s.local = self.master[slice(*self.slot_range(i))]

    def _full_numels(self, params: list[nn.Parameter]) -> list[int]:
        return [s.numel for s in _shards(params)]

    def full_shape(self, i: int) -> torch.Size:
        return self.shards[i].shape

    def _may_alias(self, params: list[nn.Parameter]) -> bool:
        return all(s.home is None for s in _shards(params))  # an offloaded parameter is not addressable

    def _unalias_master(self) -> None:
        """The master is about to be parked: fp32 shards that were its slots get storage of their own."""
        assert self.master is not None
        base = self.master.untyped_storage().data_ptr()
        for s in self.shards:
            if s.local is not None and s.local.untyped_storage().data_ptr() == base:
                s.local = s.local.clone()

    @torch.no_grad()
    def refresh_master(self, i: int) -> None:
        """Parameter i's value changed (GatheredParameters with a modifier, pretrained weights loaded): reload
        its master slot from the local shard (or, persistent, from the whole value)."""
        if self.master is None:
            return
        s = self.shards[i]
        start, end = self.slot_range(i)
        if s.local is not None:
            with s.loaded() as local:
                self.write_master_range(start, local)
            return
        lo, hi = self.plan.slots[i].owned_range(self.rank)
        view = torch.zeros(end - start, dtype=torch.float32, device=self.master.device)
        if hi > lo:
            view[: hi - lo].copy_(s.param.detach().reshape(-1)[lo:hi])
        self.write_master_range(start, view)

    @torch.no_grad()
    def copy_master_to_params(self) -> None:
        """Write-back after the step: shards locally; persistent parameters by one all-gather."""
        if self.master is None:
            return
        whole = [i for i, s in enumerate(self.shards) if s.local is None]
        for i, s in enumerate(self.shards):
            if s.local is not None:
                s.release()  # a gathered value kept for reuse would be stale after the step
                s.drop_secondary()  # hpZ: so is the secondary partition (DeepSpeed's invalidate_secondary_tensor)
            slot = self.master_range(*self.slot_range(i))
            if s.local is not None and s.local.data_ptr() == slot.data_ptr():
                continue  # aliased fp32 shard: the optimizer already updated it in place
            if s.local is not None:  # cut (one partition too under offload): local copy or write to its home
                s.write_local(slot)
        if whole and self.num_partitions == 1:
            for i in whole:
                start, _ = self.slot_range(i)
                self.params[i].copy_(self.master_range(start, start + self.params[i].numel()).view(self.params[i].shape))
        elif whole:
            self._gather_whole(whole)

    def _gather_whole(self, idx: list[int]) -> None:
        dtype = self.shards[idx[0]].dtype
        send = torch.cat([self.master_range(*self.slot_range(i)) for i in idx]).to(dtype)
        out = torch.empty(send.numel() * self.num_partitions, dtype=dtype, device=send.device)
        comm.all_gather(out, send, group=self.dp_group)
        out2d = out.view(self.num_partitions, send.numel())
        col = 0
        for i in idx:
            shard = self.plan.slots[i].shard
            gather_from(out2d, col, shard, self.params[i].data.view(-1))
            col += shard


class Stage3Reducer(GradReducer):
    """The stage-2 reducer, telling the fetcher when a parameter's gradient has been taken."""

    def __init__(self, groups: list[ShardedGroup], settings: ReduceSettings, dp_group: comm.Group | None,
                 fetcher: Fetcher, qgz: QuantizedGradients | None = None, wiring: ReducerWiring | None = None,
                 replicas: comm.Group | None = None) -> None:
        super().__init__(groups, settings, dp_group, wiring)
        self.fetcher = fetcher
        self.qgz = qgz  # ZeRO++ qgZ: buckets reduce-scattered as int4 (zero/stage3/qgz.py)
        self.replicas = replicas  # MiCS: ``dp_group`` is the shard group; partitions are summed over these too

    @torch.no_grad()
    def settle_late(self) -> None:
        """Before the optimizer step; MiCS: then sum each reduced partition over the replica group (once per
        accumulation boundary: the shard groups' partial sums become the data-parallel sum)."""
        super().settle_late()
        if self.replicas is None:
            return
        for g in range(len(self.groups)):
            comm.all_reduce(self.partition_buffer(g), group=self.replicas)

    def _direct(self) -> bool:
        return self.qgz is None  # qgZ's int4 reduce-scatter makes its own output

    def _reduce_scatter(self, g: int, b: int, send: torch.Tensor) -> tuple[torch.Tensor, comm.Handle | None]:
        if self.qgz is None:
            return super()._reduce_scatter(g, b, send)
        return self.qgz.reduce_scatter(g, self.groups[g], b, send), None

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        super()._on_grad(p)
        s = shard_of(p)
        if s is not None:
            self.fetcher.on_grad(s)

    @torch.no_grad()
    def take_grad(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        super().take_grad(p, grad)
        s = shard_of(p)
        if s is not None:
            self.fetcher.on_grad(s)

    @torch.no_grad()
    def end_micro_step(self) -> None:
        super().end_micro_step()
        self.fetcher.end_backward()
