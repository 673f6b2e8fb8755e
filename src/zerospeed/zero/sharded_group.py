"""One optimizer parameter group under ZeRO: its plan, fp32 master partition, and gradient partition.

The master is fp32 unless ``master_dtype`` says otherwise (``bf16/fp16_master_weights_and_grads``: 16-bit).

With ``N`` partitions the rank holds the fp32 master of its shards only (a flat tensor laid out as
the plan's partition); the optimizer sees one ``nn.Parameter`` view per parameter shard, so state
stays addressable per parameter. With one partition and fp32 compute the master *is* the model
parameter (no copy), as in plain data parallelism.

The master may also be *parked* (NVMe offload): its values then live in a ``MasterHome`` (swap files),
the storage of ``master`` (and so of every ``master_params`` view) is released, and readers and writers
go through :meth:`ShardedGroup.master_range` / :meth:`ShardedGroup.write_master_range`, which reach the
home range by range instead of a resident tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from .. import comm
from .layout import gather_from
from .partition import PartitionPlan, plan_partitions

_KINDS = (None, torch.float32, torch.bfloat16, torch.float16)  # a parameter's gradient dtype -> its bucket kind


class MasterHome(Protocol):
    """Where a parked master's values live (``offload/master_home.py``): ranges of the flat partition."""

    def read(self, lo: int, hi: int) -> torch.Tensor: ...

    def write(self, lo: int, src: torch.Tensor) -> None: ...


class ShardedGroup:
    # Stage 3 (a subclass) keeps the model parameters themselves partitioned: the optimizer's write-back
    # is then local (``copy_master_to_params``) instead of an all-gather of full parameters.
    params_sharded = False
    # The rank among the replicas of this group that decides who writes an unpartitioned copy in a
    # checkpoint (only replica 0 does). None: the global data-parallel rank. MoE expert groups set their
    # expert-data-parallel rank (``parallel/expert/training.py``).
    replica_rank: int | None = None

    def __init__(self, params: list[nn.Parameter], options: dict[str, Any], num_partitions: int, rank: int,
                 bucket_numel: int, compute_dtype: torch.dtype, device: torch.device | None = None,
                 defer_master: bool = False, separate_master: bool = False,
                 master_dtype: torch.dtype = torch.float32, alone: frozenset[int] = frozenset(),
                 comm_dtypes: Sequence[torch.dtype | None] | None = None) -> None:
        for p in params:
            if not p.is_contiguous():
                raise ValueError(f"parameter of shape {tuple(p.shape)} is not contiguous; ZeRO needs contiguous parameters")
        self.params = params
        self.options = options
        self.num_partitions = num_partitions
        self.rank = rank if num_partitions > 1 else 0  # position among the partitions
        # ``comm_dtypes`` (per parameter; None: the reducer's communication dtype): the dtype its gradient is
        # reduced in. Buckets hold one dtype each (``bucket_comm_dtypes``), as DeepSpeed's per-dtype IPG buckets.
        kinds = None if comm_dtypes is None else [_KINDS.index(d) for d in comm_dtypes]
        self.plan: PartitionPlan = plan_partitions(self._full_numels(params), num_partitions, bucket_numel, alone,
                                                   kinds)
        self.bucket_comm_dtypes: tuple[torch.dtype | None, ...] = tuple(
            None if comm_dtypes is None else comm_dtypes[b.params[0]] for b in self.plan.buckets)
        # ``separate_master``: keep a master copy even where the model could be it (offload with the model on an
        # accelerator: the master lives on the host, where the optimizer runs).
        self.alias = (not separate_master and num_partitions == 1 and compute_dtype == torch.float32
                      and self._may_alias(params))
        self.device = params[0].device if device is None else device
        self.master: torch.Tensor | None = None
        self.master_home: MasterHome | None = None  # set when the master is parked (values not resident)
        # NVMe offload: the master is a host placeholder without storage until ``park_master`` loads the
        # model's values straight into its home; no resident copy is ever built.
        self.master_deferred = defer_master and not self.alias
        self.master_params: list[nn.Parameter]
        if self.alias:
            self.master_params = list(params)
        elif self.master_deferred:
            self.master = torch.empty(self.plan.partition_numel, dtype=master_dtype)  # untouched: no RSS
            self.master_params = [nn.Parameter(self.slot_view(self.master, i)) for i in range(len(params))]
            self.master.untyped_storage().resize_(0)
        else:
            self.master = torch.zeros(self.plan.partition_numel, dtype=master_dtype, device=self.device)
            self.master_params = [nn.Parameter(self.slot_view(self.master, i)) for i in range(len(params))]
            self.load_master_from_params()

    def _may_alias(self, params: list[nn.Parameter]) -> bool:
        """Whether the model parameters may serve as the fp32 master (stage 3 says no when offloaded)."""
        return True

    def full_shape(self, i: int) -> torch.Size:
        """Parameter i's full shape (stage 3 reads it from its shard state: the data may be a placeholder)."""
        return self.params[i].shape

    def _full_numels(self, params: list[nn.Parameter]) -> list[int]:
        """Elements of each full parameter (stage 3 reads them from its shard state)."""
        return [p.numel() for p in params]

    # --- range helpers ---------------------------------------------------------------------------
    def slot_range(self, i: int) -> tuple[int, int]:
        """Partition-flat range of parameter i's shard."""
        slot = self.plan.slots[i]
        start = self.plan.buckets[slot.bucket].partition_offset + slot.offset
        return start, start + slot.shard

    def slot_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        start, end = self.slot_range(i)
        if self.num_partitions == 1:
            return flat[start:start + self.plan.slots[i].numel].view(self.full_shape(i))
        return flat[start:end]

    # --- the master, resident or parked ---------------------------------------------------------
    def master_range(self, lo: int, hi: int) -> torch.Tensor:
        """Master elements ``[lo, hi)`` of the flat partition: a view when resident, else read from the home."""
        assert self.master is not None and not self.master_deferred, "the deferred master has no home yet"
        if self.master_home is None:
            return self.master[lo:hi]
        return self.master_home.read(lo, hi)

    @torch.no_grad()
    def write_master_range(self, lo: int, src: torch.Tensor) -> None:
        """Overwrite master elements ``[lo, lo + src.numel())`` (in place, or in the home when parked)."""
        assert self.master is not None and not self.master_deferred, "the deferred master has no home yet"
        if self.master_home is None:
            self.master[lo:lo + src.numel()].copy_(src.reshape(-1))
        else:
            self.master_home.write(lo, src.detach().to("cpu", torch.float32).reshape(-1).contiguous())

    def park_master(self, home: MasterHome) -> None:
        """The master's values now live in ``home``: release its storage (``master_params`` keep their
        metadata and identity, so the optimizer and its state still address them)."""
        assert self.master is not None
        self._unalias_master()
        self.master_home = home
        self.master.untyped_storage().resize_(0)
        if self.master_deferred:  # first values: read from the model, written range by range into the home
            self.master_deferred = False
            self.load_master_from_params()

    @torch.no_grad()
    def unpark_master(self) -> None:
        """Bring a parked master back into memory (its home is about to go away)."""
        home = self.master_home
        if home is None or self.master is None:
            return
        values = home.read(0, self.master.numel())
        self.master.untyped_storage().resize_(self.master.numel() * self.master.element_size())
        self.master_home = None
        self.master.copy_(values)

    def _unalias_master(self) -> None:
        """Give anything that shares the master's storage its own (stage 3's fp32 shards do)."""

    # --- master <-> model ------------------------------------------------------------------------
    @torch.no_grad()
    def load_master_from_params(self) -> None:
        """Copy this rank's shards of the model parameters into the fp32 master partition."""
        for i in range(len(self.params)):
            self.refresh_master(i)

    @torch.no_grad()
    def refresh_master(self, i: int) -> None:
        """Parameter i's model value is new (loaded, or set outside training): copy this rank's elements of it
        into its master slot (nothing to do when the model parameter is itself the master)."""
        if self.master is None:
            return
        slot = self.plan.slots[i]
        lo, hi = slot.owned_range(self.rank)
        start, _ = self.slot_range(i)
        view = torch.zeros(slot.shard, dtype=self.master.dtype, device=self.master.device)
        if hi > lo:
            view[: hi - lo].copy_(self.params[i].detach().reshape(-1)[lo:hi])
        self.write_master_range(start, view)

    def attach_grads(self, part_grad: torch.Tensor | None) -> None:
        """Point every master parameter's ``.grad`` at its slice of the fp32 gradient partition."""
        for i, mp in enumerate(self.master_params):
            mp.grad = None if part_grad is None else self.slot_view(part_grad, i)

    @torch.no_grad()
    def copy_master_to_params(self) -> None:
        """One partition: cast the fp32 master back into the model parameters (no communication)."""
        if self.master is None:
            return
        for i, p in enumerate(self.params):
            start, _ = self.slot_range(i)
            p.copy_(self.master_range(start, start + p.numel()).view(p.shape))

    @torch.no_grad()
    def gather_in_place(self, group: comm.Group | None) -> None:
        """Write-back without a full buffer: this rank's master slices into its own shard of every parameter, then
        an in-place all-gather of every (parameter, rank) shard into the parameters, packed into a few
        broadcasts per rank (``comm/packed.py``: on Gloo, one broadcast per shard costs more CPU than the copies)."""
        pieces: list[list[torch.Tensor]] = [[] for _ in range(self.num_partitions)]
        for i, p in enumerate(self.params):
            slot, flat = self.plan.slots[i], p.data.view(-1)
            for r in range(self.num_partitions):
                lo, hi = slot.owned_range(r)
                if hi > lo:
                    pieces[r].append(flat[lo:hi])
            lo, hi = slot.owned_range(self.rank)
            if hi > lo:
                start, _ = self.slot_range(i)
                flat[lo:hi].copy_(self.master_range(start, start + hi - lo))
        comm.all_gather_packed(pieces, group)

    @torch.no_grad()
    def unpack_gathered(self, out: torch.Tensor, buckets: range) -> None:
        """Write an all-gathered run of buckets (``[N, L]`` rank-major) into the model parameters."""
        first = self.plan.buckets[buckets.start]
        length = sum(self.plan.buckets[b].shard_numel for b in buckets)
        out2d = out.view(self.num_partitions, length)
        for b in buckets:
            bucket = self.plan.buckets[b]
            base = bucket.partition_offset - first.partition_offset
            for i in bucket.params:
                slot = self.plan.slots[i]
                gather_from(out2d, base + slot.offset, slot.shard, self.params[i].data.view(-1))

    def gather_runs(self, cap_numel: int) -> list[range]:
        """Consecutive buckets coalesced so each all-gather output stays within ``cap_numel`` elements."""
        runs: list[range] = []
        start, size = 0, 0
        for b, bucket in enumerate(self.plan.buckets):
            padded = bucket.shard_numel * self.num_partitions
            if b > start and size + padded > cap_numel:
                runs.append(range(start, b))
                start, size = b, 0
            size += padded
        if self.plan.buckets:
            runs.append(range(start, len(self.plan.buckets)))
        return runs

    def master_bytes(self) -> int:
        """Bytes of fp32 master resident in memory (0 while parked)."""
        return 0 if self.master is None else self.master.untyped_storage().nbytes()
