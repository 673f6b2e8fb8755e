"""The ZeRO optimizer: one implementation for stages 0, 1 and 2 (the stage is a setting).

At the accumulation boundary: take the reduced fp32 gradient partition, detect overflow (any rank),
compute the global gradient norm over all partitions, unscale and clip in one multiply, step the
wrapped torch optimizer on this rank's fp32 master shards, then rebuild the full model parameters
(stage 0: copy; stages 1-2: all-gather the updated shards, bucket by bucket; stage 3: update each
parameter's local shard, no communication).

Commit point: the norm's all-reduce (stage 0 with several ranks: an all-reduce too, although every rank
holds the same gradient) comes after everything that may fail before the update and before the first
parameter changes. A rank that raised earlier in the step never joins it, so its peers fail there and no
rank updates alone (``runtime/engine.py``). ``updating`` is true from there to the end of the update.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import comm
from ..accelerator.huge_pages import empty_buffer
from ..optim.frozen_variance import frozen_variance_step, preconditioner
from ..precision import LossScaler
from .grad_reducer import GradReducer
from .norm_axes import NormAxes
from .partition import reduce_bucket_numel
from .sharded_group import ShardedGroup
from .squares import sum_of_squares


class ZeroOptimizer:
    """Wraps a torch optimizer whose params are the master shards of ``groups``."""

    def __init__(self, groups: list[ShardedGroup], optimizer: torch.optim.Optimizer, reducer: GradReducer,
                 scaler: LossScaler, dp_group: comm.Group | None, clip: float, compute_dtype: torch.dtype,
                 allgather_bucket_numel: int, stepper: Any = None, allgather_partitions: bool = True,
                 check_grad_overflow: bool = False, norm_axes: NormAxes | None = None,
                 momentum_exchange: Any = None) -> None:
        # the parallelisms beyond data parallelism that the norm and the overflow flag span (zero/norm_axes.py)
        self.norm_axes = NormAxes() if norm_axes is None else norm_axes
        # ZeRO-Offload (offload/stepper.py): when set, steps the host-resident masters instead of optimizer.step().
        self.stepper = stepper
        # gradient_compression.freeze_variance: Adam's variance is frozen after this many steps (the top-k
        # warm-up) (optim/frozen_variance.py); None: off.
        self.freeze_variance_at: int | None = None
        self.momentum_correction = False  # gradient_compression.momentum_correction: ranks exchange their momentum
        self.preconditioned_selection = False  # ... preconditioned_selection: top-k ranks entries by |x| / sqrt(v)
        self.momentum_exchange = momentum_exchange  # ... momentum_exchange: a TopkMomentumExchange (zero/topk_momentum.py)
        self.groups = groups
        self.optimizer = optimizer
        self.reducer = reducer
        self.loss_scaler = scaler
        self.dp_group = dp_group
        self.clip = clip
        self.compute_dtype = compute_dtype
        self.allgather_bucket_numel = allgather_bucket_numel
        self.overflow = False
        self.allgather_partitions = allgather_partitions  # false: rebuild parameters with one broadcast per rank
        # Skip steps whose gradients hold inf/nan on any rank even without a loss scale (fp16 always, as in
        # DeepSpeed; bf16 when bf16.check_grad_overflow): weights, optimizer state and schedule stay untouched.
        self.check_grad_overflow = check_grad_overflow
        self.global_grad_norm: float | None = None
        self.updating = False
        self.partitioned = any(g.num_partitions > 1 for g in groups)
        settings = reducer.s
        if settings.topk_ratio > 0 and settings.topk_freeze_variance:
            self.freeze_variance_at = settings.topk_warmup_steps
            self.momentum_correction = settings.topk_momentum_correction
            self.preconditioned_selection = settings.topk_preconditioned_selection
        self._fp32_grads: list[torch.Tensor | None] = [None] * len(groups)
        if self.partitioned and hasattr(optimizer, "shard_norm_reducer"):
            # Lamb: its per-tensor norms must be the whole parameter's, not this rank's shard's.
            optimizer.shard_norm_reducer = self._sum_over_shards
        if self.partitioned and hasattr(optimizer, "shard_orthogonalizer"):
            # Muon: Newton-Schulz needs each matrix whole; owners orthogonalise them (zero/muon_exchange.py).
            from .muon_exchange import MuonShardExchange

            optimizer.shard_orthogonalizer = MuonShardExchange(groups, lambda grp: self.gather_group(grp))

    # --- torch.optim.Optimizer-like surface -------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.zero()
        for g in self.groups:
            g.attach_grads(None)

    # --- the step ---------------------------------------------------------------------------------
    @property
    def _sink(self) -> Any:
        """Where the reduced gradients went instead of memory (NVMe offload), or None."""
        return getattr(self.reducer, "sink", None)

    def grad_partitions(self) -> list[torch.Tensor]:
        """The fp32 gradient partitions held for the step now (empty outside one)."""
        return [t for t in self._fp32_grads if t is not None]

    def _collect_grads(self) -> list[torch.Tensor]:
        sink = self._sink
        if sink is not None and not sink.resident:  # NVMe offload: the reduced gradients are in the swap files
            return []
        grads = []
        for gi, grp in enumerate(self.groups):
            part = self.reducer.partition_buffer(gi) if sink is None else sink.partition(gi)  # host (offload)
            want = grp.master.dtype if grp.master is not None else torch.float32  # a .grad has its master's dtype
            grad = part if part.dtype == want else part.to(want)
            self._fp32_grads[gi] = grad
            grp.attach_grads(grad)
            grads.append(grad)
        return grads

    def _has_overflow(self, grads: list[torch.Tensor]) -> bool:
        local = any(not bool(torch.isfinite(g).all()) for g in grads)
        if self._sink is not None and not self._sink.resident:
            local = local or not self._sink.all_finite()
        # one verdict over every axis; also a commit point: the scale changes
        return comm.all_reduce_max_flag(local, group=self.norm_axes.union(self.dp_group))

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        axes, sink = self.norm_axes, self._sink
        nvme = sink is not None and not sink.resident
        if not axes.multi_axis and not self.partitioned:  # every rank holds every gradient: no sum to take
            if comm.get_world_size(self.dp_group) > 1:  # same value everywhere: only the commit point
                comm.all_reduce_max_flag(False, group=self.dp_group)
            if not nvme:  # torch's clip_grad_norm_ arithmetic: the norm of the per-parameter norms
                norms = [torch.linalg.vector_norm(grp.slot_view(g, i), dtype=torch.float32)
                         for grp, g in zip(self.groups, grads) for i in range(len(grp.params))]
                return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
            sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
            for g in grads:  # no gradient-sized temporary (pow(2) would make one: 4 bytes/param)
                sq += sum_of_squares(g)
            sq += sink.sum_sq()  # sums of squares recorded as they were written
            return math.sqrt(float(sq))
        if nvme and (axes.tp_group is not None or axes.replicated):
            raise ValueError("tensor or pipeline parallelism with NVMe optimizer offload of gradients is not "
                             "supported yet by zerospeed")
        sq = axes.owned_squares(self.groups, grads, self.dp_group)
        if nvme:  # squares recorded per (group, sub-group) as they were written
            for (gi, _), v in sink.sq.items():
                if axes.owns_group(gi, self.groups[gi], self.dp_group):
                    sq = sq + v.to(sq.device, torch.float64)
        union = axes.union(self.dp_group)
        sq = sq.to(comm.device_for_backend(union)).reshape(1)  # offloaded grads live on host; NCCL needs the device
        comm.all_reduce(sq, group=union)
        return math.sqrt(max(float(sq), 0.0))

    def _sum_over_shards(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a flat vector of per-parameter partial sums over the data-parallel shards (one all-reduce)."""
        out = partial.to(comm.device_for_backend(self.dp_group))
        comm.all_reduce(out, group=self.dp_group)
        return out.to(partial.device)

    @torch.no_grad()
    def step(self) -> bool:
        """Apply one optimizer step; returns False when skipped for overflow."""
        self.reducer.settle_late()  # gradients of once-unused parameters that arrived after their bucket left
        grads = self._collect_grads()
        scale = self.loss_scaler.loss_scale
        check = self.check_grad_overflow or self.loss_scaler.dynamic or scale != 1.0
        self.overflow = self._has_overflow(grads) if check else False
        if self.overflow:
            self.global_grad_norm = None
            if self.stepper is not None:
                self.stepper.on_skipped_step()  # SuperOffload: undo the steps it started during backward
            self._release()
            self.loss_scaler.update(True)  # may raise (fp16 at its minimum scale): gradients already released
            return False
        norm = self._global_norm(grads) / scale
        self.global_grad_norm = norm
        mult = 1.0 / scale
        if self.clip > 0:  # the coefficient rounded as torch's clip_grad_norm_ rounds it (fp32 arithmetic)
            coef = float(torch.tensor(self.clip, dtype=torch.float32) / (torch.tensor(norm, dtype=torch.float32) + 1e-6))
            if coef < 1.0:
                mult *= coef
        self.updating = True
        if mult != 1.0:
            for g in grads:
                g.mul_(mult)
            if self._sink is not None and not self._sink.resident:
                self._sink.scale = mult  # applied by the stepper as it reads each sub-group
        if self.stepper is not None:
            self.stepper.step(grads)
        elif self.freeze_variance_at is not None and self.reducer.compressor.steps >= self.freeze_variance_at:
            exchange = self.momentum_exchange
            if exchange is not None:  # each group's local gradient becomes the exchanged top-k momentum
                exchange.exchange_groups(self.optimizer, self.groups, grads, self._param_group, self.freeze_variance_at)
            frozen_variance_step(self.optimizer, self.freeze_variance_at,
                                 bool(self.reducer.compressor.momentum) or exchange is not None,
                                 exchange is not None and exchange.local_variance)
        else:
            self.optimizer.step()
        self.loss_scaler.update(False)
        self._write_back()
        self._release()
        self.set_compression_steps(self.reducer.compressor.steps + 1)
        self.updating = False
        return True

    def set_compression_steps(self, steps: int) -> None:
        """Optimizer steps taken, for the top-k warm-up (also after a checkpoint load: collective when the
        variance freezes, since stage 1 all-gathers the preconditioner once)."""
        compressor = self.reducer.compressor
        compressor.steps = steps
        at = self.freeze_variance_at
        if at is None or steps < at or (compressor.scale and steps > at):
            return
        if self.momentum_correction:
            compressor.momentum = {gi: self._beta1(grp) for gi, grp in enumerate(self.groups)}
        if not self.preconditioned_selection:
            return
        scales: dict[tuple[int, int], torch.Tensor] = {}
        for gi, grp in enumerate(self.groups):
            part = torch.zeros(grp.plan.partition_numel, dtype=torch.float32, device=grp.device)
            for i, mp in enumerate(grp.master_params):
                view = grp.slot_view(part, i)
                view.copy_(preconditioner(self.optimizer, mp, at).reshape(view.shape))
            for bucket in grp.plan.buckets:
                mine = part[bucket.partition_offset: bucket.partition_offset + bucket.shard_numel]
                if grp.num_partitions == 1:
                    scales[(gi, bucket.index)] = mine
                    continue
                full = torch.empty(mine.numel() * grp.num_partitions, dtype=mine.dtype, device=mine.device)
                comm.all_gather(full, mine, group=self.gather_group(grp))
                scales[(gi, bucket.index)] = full
        compressor.scale = scales

    def abandon_step(self) -> None:
        """After an exception in forward, backward or step: drop the step's gradients and buffers."""
        self.updating = False
        for gi, grp in enumerate(self.groups):
            grp.attach_grads(None)
            self._fp32_grads[gi] = None
        self.reducer.reset()

    def _release(self) -> None:
        for gi, grp in enumerate(self.groups):
            grp.attach_grads(None)
            self._fp32_grads[gi] = None
        self.reducer.zero()

    def _beta1(self, grp: ShardedGroup) -> float:
        return float(self._param_group(grp)["betas"][0])

    def _param_group(self, grp: ShardedGroup) -> dict[str, Any]:
        for pg in self.optimizer.param_groups:
            if any(p is grp.master_params[0] for p in pg["params"]):
                return pg
        return self.optimizer.param_groups[0]

    def gather_group(self, grp: ShardedGroup) -> comm.Group | None:
        """The group over which ``grp`` is partitioned (MoE: experts' over their expert-data-parallel group)."""
        return self.norm_axes.shard_group(self.groups.index(grp), self.dp_group)

    def _write_back(self) -> None:
        for gi, grp in enumerate(self.groups):
            if grp.alias:
                continue
            if grp.num_partitions == 1 or grp.params_sharded:
                grp.copy_master_to_params()
                continue
            self._gather_group(gi, grp)

    def _gather_group(self, gi: int, grp: ShardedGroup) -> None:
        """All-gather the updated partitions into the parameters, run by run: run k+1's all-gather is in flight
        while run k is unpacked. Outputs: the full gradient buffer where one exists (stages 0-1: its reduced
        contents are spent and it is zeroed next), else two buffers of the largest run, reused."""
        assert grp.master is not None
        if self.allgather_partitions and grp.master_home is None \
                and comm.gathers_in_place(grp.params[0], self.gather_group(grp)):
            grp.gather_in_place(self.gather_group(grp))
            return
        cap = self.allgather_bucket_numel
        full = self._spent_full_buffer(gi, grp)
        if full is None:  # stage 2: runs no larger than its transient gradient buckets
            cap = min(cap, reduce_bucket_numel(cap, [p.numel() for p in grp.params], 2, grp.num_partitions))
        runs = grp.gather_runs(cap)
        sizes = [sum(grp.plan.buckets[b].shard_numel for b in run) * grp.num_partitions for run in runs]
        if full is not None and full.dtype == self.compute_dtype and full.device == grp.device:
            bufs = [full]
        else:
            bufs = [empty_buffer(max(sizes), self.compute_dtype, grp.device) for _ in runs[:2]]
        overlap = self.allgather_partitions
        previous: tuple[comm.Handle | None, torch.Tensor, range] | None = None
        offset = 0
        for k, run in enumerate(runs):
            first = grp.plan.buckets[run.start]
            last = grp.plan.buckets[run.stop - 1]
            send = grp.master_range(first.partition_offset, last.partition_offset + last.shard_numel)
            send = send.to(device=grp.device, dtype=self.compute_dtype)  # offloaded masters live on host
            if len(bufs) == 1:
                out, offset = bufs[0][offset:offset + sizes[k]], offset + sizes[k]
            else:
                out = bufs[k % 2][:sizes[k]]
            handle = None
            if not self.allgather_partitions:
                comm.all_gather_by_broadcast(out, send, group=self.gather_group(grp))
            else:
                handle = comm.all_gather(out, send, group=self.gather_group(grp), async_op=overlap)
            if previous is not None:
                self._unpack(grp, *previous)
            previous = (handle, out, run)
        if previous is not None:
            self._unpack(grp, *previous)

    def _spent_full_buffer(self, gi: int, grp: ShardedGroup) -> torch.Tensor | None:
        """Group gi's full-size gradient buffer (stages 0-1), whose contents are spent once reduced; None if none."""
        groups = self.reducer.groups
        return self.reducer.full_buffer(gi) if gi < len(groups) and groups[gi] is grp else None

    @staticmethod
    def _unpack(grp: ShardedGroup, handle: comm.Handle | None, out: torch.Tensor, run: range) -> None:
        if handle is not None:
            handle.wait()
        grp.unpack_gathered(out, run)

    # --- accounting -------------------------------------------------------------------------------
    def optimizer_state_bytes(self) -> int:
        if self.stepper is not None:  # offloaded: what is held in host memory
            return int(self.stepper.host_state_bytes())
        total = 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.numel() > 1:
                    total += v.numel() * v.element_size()
        return total

    def master_bytes(self) -> int:
        return sum(g.master_bytes() for g in self.groups)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "loss_scaler": self.loss_scaler.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(sd["optimizer"])
        self.loss_scaler.load_state_dict(sd["loss_scaler"])
