"""Gradient reduction from backward hooks, in buckets, overlapped with the rest of backward.

Each parameter's gradient is moved, as soon as autograd has accumulated it, into its column block
of a rank-major bucket buffer (see ``partition``) and the parameter's own ``.grad`` is freed. When
every gradient of a bucket has arrived (on a micro-step that communicates), the bucket's collective
is launched asynchronously, always in bucket order so every rank issues the same sequence:

* stage 0: all-reduce the bucket (one partition: every rank keeps the full averaged gradient);
* stage 1: gradients accumulate locally in full-size buffers; on the accumulation boundary each
  bucket is reduce-scattered into this rank's fp32 gradient partition;
* stage 2: no full-size buffer: every micro-step reduce-scatters a transient bucket buffer and adds
  the result into the gradient partition. With ``local_accumulation`` (zerospeed's top-level
  ``zero_local_grad_accumulation``) the first micro-step that does not end an accumulation allocates
  stage 1's full-size buffers, and from then on stage 2 accumulates locally and reduce-scatters once
  per boundary: 2Ψ on the wire per step instead of (gas+1)Ψ, for 4Ψ more bytes (fp32) per rank.

Unused parameters: a parameter that got no gradient in the first backward on any rank (agreed by one
all-reduce, once) is from then on treated as arrived, so its bucket (and every bucket after it, launched
in order) does not wait for the end of backward. Should it get a gradient later, after its bucket was
launched, that gradient goes to a *late* buffer of the bucket's layout; at the optimizer step one
4-byte all-reduce (only for models that have such parameters) tells every rank whether any rank holds
late gradients, and if so the affected buckets are reduced once more and added in (same result as if
they had waited), and their parameters are waited for again from then on. At most
``MAX_IN_FLIGHT`` buckets are in flight: launching one more first completes the oldest, so stage 2's
transient bucket buffers stay bounded (about two buckets) instead of adding up to the whole model.

Gradients that arrive outside this reducer's own micro-step (another engine's backward reaching these
parameters, e.g. a GAN generator's loss through the discriminator) are left in ``p.grad`` for the user's
``zero_grad()``, as in plain PyTorch; stage 3 cannot keep a full gradient beside a partitioned parameter
and raises instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import comm
from ..accelerator.huge_pages import empty_buffer, zeros_buffer
from .layout import padding_ranges, scatter_into
from .sharded_group import ShardedGroup


MAX_IN_FLIGHT = 2  # bucket collectives launched and not yet completed (double buffering)


@dataclass(frozen=True)
class ReduceSettings:
    stage: int
    dp_size: int
    accum_dtype: torch.dtype
    comm_dtype: torch.dtype
    reduce_scatter: bool = True
    overlap_comm: bool = True
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    topk_ratio: float = 0.0  # > 0: top-k sparsified averaging (comm/sparse.py) instead of the dense collective
    topk_error_feedback: bool = True
    topk_warmup_steps: int = 0  # optimizer steps reduced densely before sparsification starts
    topk_freeze_variance: bool = False  # then Adam's variance frozen (ZeroOptimizer)
    topk_momentum_correction: bool = False  # and each rank's momentum exchanged instead of its gradient (DGC)
    topk_preconditioned_selection: bool = False  # and entries ranked by |x| / sqrt(v)
    # No gradient partition buffer: each bucket's reduced slice goes to ``GradReducer.sink`` (offload/grad_sink.py:
    # NVMe offload at stages 2-3 streams it to the swap files; CPU offload on an accelerator to host memory).
    partition_sink: bool = False
    # Stage 2: accumulate micro-steps in full-size buffers (made on the first non-boundary micro-step) and
    # reduce once per accumulation boundary, as stage 1 does; the gradient partition stays stage 2's.
    local_accumulation: bool = False


@dataclass(frozen=True)
class ReducerWiring:
    """The reducer's collaborators, given at construction (``runtime/build_optimizer.py``)."""

    # Where reduced slices go under ``settings.partition_sink`` (``add(g, partition_offset, values)``,
    # ``end_micro_step()``, ``zero()``): offload/grad_sink.py.
    sink: Any = None
    # Host engines: a HeapTrimmer (accelerator/host_malloc.py) asked at each bucket launch to give back the
    # activations' freed heap.
    heap_trimmer: Any = None
    # DeepSpeed's ``enable_backward_allreduce``: when this returns False (a 1-bit optimizer in its
    # compression phase, stage 0 only) each rank keeps its local gradient; the optimizer averages.
    allreduce_gate: Callable[[], bool] | None = None
    names: dict[nn.Parameter, str] = field(default_factory=dict)  # parameter names, for messages
    ignore_unused_parameters: bool = True  # zero_optimization.ignore_unused_parameters (stages 1-2)


class _Pending:
    """A bucket's collective in flight. ``direct``: its reduce-scatter writes straight into the gradient partition
    (which then only needs scaling in place)."""

    def __init__(self, g: int, b: int, handle: comm.Handle | None, send: torch.Tensor, out: torch.Tensor | None,
                 local: bool = False, direct: bool = False) -> None:
        self.g, self.b, self.handle, self.send, self.out, self.local = g, b, handle, send, out, local
        self.direct = direct


class GradReducer:
    def __init__(self, groups: list[ShardedGroup], settings: ReduceSettings, dp_group: comm.Group | None,
                 wiring: ReducerWiring | None = None) -> None:
        w = ReducerWiring() if wiring is None else wiring
        self.sink = w.sink
        self.heap_trimmer = w.heap_trimmer
        self.groups = groups
        self.s = settings
        self.dp_group = dp_group
        self.order = [(g, b) for g, grp in enumerate(groups) for b in range(len(grp.plan.buckets))]
        self.position = {key: i for i, key in enumerate(self.order)}
        self.expected = [len(groups[g].plan.buckets[b].params) for g, b in self.order]
        self.arrived = [0] * len(self.order)
        self.next_launch = 0
        self.pending: list[_Pending] = []
        self.communicate = True
        self.first_micro_step = True
        self.allreduce_gate = w.allreduce_gate  # see ReducerWiring (top-k momentum exchange may set it later)
        self.residual: dict[tuple[int, int], torch.Tensor] = {}  # top-k error feedback, per bucket
        self.topk_steps = 0  # optimizer steps taken (set by ZeroOptimizer): top-k starts at topk_warmup_steps
        self.topk_scale: dict[tuple[int, int], torch.Tensor] = {}  # per bucket: rank entries by |g| * scale
        # gradient_compression.momentum_correction (DGC): per group, beta1 of each rank's own momentum, kept
        # per bucket in ``velocity``; what top-k then exchanges is momentum (set by ZeroOptimizer at the freeze).
        self.topk_momentum: dict[int, float] = {}
        self.velocity: dict[tuple[int, int], torch.Tensor] = {}
        dev = groups[0].device if groups else torch.device("cpu")
        # Full-size accumulation buffers (stages 0 and 1, or a single partition) or transient per-bucket
        # ones (stage 2).
        self.full: list[torch.Tensor | None] = [
            zeros_buffer(g.plan.padded_numel, settings.accum_dtype, dev)
            if settings.stage < 2 or (g.num_partitions == 1 and not settings.partition_sink) else None
            for g in groups
        ]
        self.staging: dict[tuple[int, int], torch.Tensor] = {}
        # Transient bucket buffers whose collective has completed, for the next buckets of the same micro-step
        # (a fresh host buffer costs a page fault per 4 KiB on first touch: ~10x the copy that fills it);
        # let go at the end of the micro-step, so none is held through the next forward.
        self.spare: list[torch.Tensor] = []
        self.pads: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # see _padding
        self.accumulates_locally = False  # stage 2 with local_accumulation, once its full buffers exist
        # This rank's reduced gradient partition, in the accumulation dtype.
        self.partition: list[torch.Tensor | None] = [None] * len(groups)
        self.unwritten: list[set[int]] = [set() for _ in groups]  # buckets of a partition no reduce has written yet
        self.where: dict[nn.Parameter, tuple[int, int]] = {}
        self.active = False  # inside this engine's backward (begin_micro_step .. end_micro_step)
        self.got: set[tuple[int, int]] = set()  # (group, index) that got a gradient in this backward
        self.window_got: set[tuple[int, int]] = set()  # ... since the last zero() (the accumulation window)
        self.unused: set[tuple[int, int]] | None = None  # learned from the first backward (same on every rank)
        self.late: dict[int, torch.Tensor] = {}  # bucket position -> gradients that arrived after its launch
        self.boundary = True
        self.ignore_unused_parameters = w.ignore_unused_parameters
        self.names: dict[nn.Parameter, str] = w.names  # for messages
        self.early_launches = 0  # bucket collectives launched from a gradient hook, during backward
        self.peak_buffer_bytes = 0  # largest grad_bytes() seen when a transient bucket buffer was made
        self.hooks = []
        for g, grp in enumerate(groups):
            for i, p in enumerate(grp.params):
                self.where[p] = (g, i)
                self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # --- buffers ---------------------------------------------------------------------------------
    def _bucket_buffer(self, g: int, b: int) -> torch.Tensor:
        grp = self.groups[g]
        bucket = grp.plan.buckets[b]
        n = grp.num_partitions
        full = self.full[g]
        if full is not None:
            return full[n * bucket.partition_offset: n * (bucket.partition_offset + bucket.shard_numel)]
        buf = self.staging.get((g, b))
        if buf is None:  # uninitialised: each gradient is copied in (not added to zeros); the rest is zeroed
            buf = self._spare(n * bucket.shard_numel, grp.device)
            view = buf.view(n, bucket.shard_numel)
            for row, lo, hi in self._padding(g, b):
                view[row:, lo:hi].zero_()
            self.staging[(g, b)] = buf
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.grad_bytes())
        return buf

    def _spare(self, numel: int, device: torch.device) -> torch.Tensor:
        """A transient bucket buffer of ``numel`` elements: a spent one of this micro-step if one is large enough."""
        for k, t in enumerate(self.spare):
            if t.numel() >= numel and t.device == device:
                return self.spare.pop(k)[:numel]
        return empty_buffer(numel, self.s.accum_dtype, device)

    def _retire(self, g: int, b: int) -> None:
        """Bucket (g, b)'s transient buffer is spent: keep it for the next bucket of this micro-step."""
        buf = self.staging.pop((g, b), None)
        if buf is not None:
            base = buf._base if buf._base is not None else buf
            self.spare.append(base if base.dim() == 1 and base.dtype == buf.dtype else buf)

    def _padding(self, g: int, b: int) -> list[tuple[int, int, int]]:
        """Bucket (g, b)'s padding (``layout.padding_ranges``), computed once."""
        pads = self.pads.get((g, b))
        if pads is None:
            grp = self.groups[g]
            pads = self.pads[(g, b)] = padding_ranges((grp.plan.slots[i] for i in grp.plan.buckets[b].params),
                                                      grp.num_partitions)
        return pads

    def _zero_missing(self, g: int, b: int, buf: torch.Tensor) -> None:
        """Before a transient bucket buffer is reduced: zero the columns of parameters that sent no gradient."""
        grp = self.groups[g]
        view = buf.view(grp.num_partitions, grp.plan.buckets[b].shard_numel)
        for i in grp.plan.buckets[b].params:
            if (g, i) not in self.got:
                slot = grp.plan.slots[i]
                view[:, slot.offset: slot.offset + slot.shard].zero_()

    def partition_buffer(self, g: int) -> torch.Tensor:
        """The reduced gradient partition of group g (accumulation dtype)."""
        grp = self.groups[g]
        if grp.num_partitions == 1:
            full = self.full[g]
            assert full is not None, "a single partition always has a full gradient buffer"
            return full
        part = self.partition[g]
        if part is None:
            part = zeros_buffer(grp.plan.partition_numel, self.s.accum_dtype, grp.device)
            self.partition[g] = part
        for b in self.unwritten[g]:  # a reader sees zeros where no reduce has written yet
            bucket = grp.plan.buckets[b]
            part[bucket.partition_offset: bucket.partition_offset + bucket.shard_numel].zero_()
        self.unwritten[g] = set()
        return part

    def _reduce_target(self, g: int, b: int) -> tuple[torch.Tensor, bool]:
        """Bucket b's slice of group g's partition, and whether no reduce has written it since it was made (the
        result is then copied in, not added to zeros: the partition is made uninitialised for the reduces)."""
        grp = self.groups[g]
        if self.partition[g] is None:
            self.partition[g] = empty_buffer(grp.plan.partition_numel, self.s.accum_dtype, grp.device)
            self.unwritten[g] = set(range(len(grp.plan.buckets)))
        fresh = b in self.unwritten[g]
        self.unwritten[g].discard(b)
        bucket = grp.plan.buckets[b]
        return self.partition[g][bucket.partition_offset: bucket.partition_offset + bucket.shard_numel], fresh  # type: ignore[index]

    # --- hooks -----------------------------------------------------------------------------------
    def _name(self, g: int, i: int) -> str:
        p = self.groups[g].params[i]
        return self.names.get(p, f"parameter {i} of group {g} ({self.groups[g].plan.slots[i].numel} elements)")

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        g, i = self.where[p]  # type: ignore[index]
        grp = self.groups[g]
        slot = grp.plan.slots[i]
        grad = p.grad
        if grad is None:
            return
        if not self.active:
            self._outside_backward(g, i)
            return
        k = self.position[(g, slot.bucket)]
        unused = self.unused is not None and (g, i) in self.unused
        late = unused and self.communicate and k < self.next_launch and self.s.dp_size > 1
        bucket = grp.plan.buckets[slot.bucket]
        buf = self.late.get(k) if late else self._bucket_buffer(g, slot.bucket)
        if buf is None:
            buf = self.late[k] = torch.zeros(grp.num_partitions * bucket.shard_numel, dtype=self.s.accum_dtype,
                                             device=grp.device)
        first = not late and self.full[g] is None and (g, i) not in self.got  # into an uninitialised staging buffer
        scatter_into(buf.view(grp.num_partitions, bucket.shard_numel), slot.offset, slot.shard,
                     grad.reshape(-1), accumulate=not first)
        p.grad = None
        self.got.add((g, i))
        if unused:  # not counted: the bucket must still wait for every parameter it expects
            return
        self.arrived[k] += 1
        if self.communicate and self.s.overlap_comm and self.arrived[k] >= self.expected[k]:
            self._launch_ready(early=True)

    def _outside_backward(self, g: int, i: int) -> None:
        """A gradient from someone else's backward: leave it in ``p.grad`` (stages 0-2) or refuse (stage 3)."""
        if self.s.stage >= 3:
            self.groups[g].params[i].grad = None
            raise RuntimeError(
                f"a gradient for {self._name(g, i)} arrived outside this engine's backward() (another engine's "
                "backward reached its parameters, e.g. a GAN generator loss through the discriminator). Under "
                "ZeRO stage 3 the parameter is partitioned, so its full gradient cannot be kept in p.grad: stop "
                "the gradient (detach, or requires_grad_(False) on these parameters for that backward), or use "
                "stage 0-2, where such gradients stay in p.grad as in plain PyTorch.")

    def _learn_unused(self) -> None:
        """After the first backward: parameters that got no gradient on any rank count as arrived from now on."""
        keys = [(g, i) for g, grp in enumerate(self.groups) for i in range(len(grp.params))]
        got = torch.tensor([float(key in self.got) for key in keys], device=comm.device_for_backend(self.dp_group)
                           if self.s.dp_size > 1 else None)
        if self.s.dp_size > 1:
            comm.all_reduce_flags(got, group=self.dp_group)
        self.unused = {key for key, used in zip(keys, got.tolist()) if not used}
        for g, i in self.unused:
            self.expected[self.position[(g, self.groups[g].plan.slots[i].bucket)]] -= 1

    @torch.no_grad()
    def settle_late(self) -> None:
        """Before the optimizer step: add in gradients that arrived after their bucket was launched.

        Collective (every rank decides alike: the unused set is agreed). Costs one 4-byte all-reduce per
        step for models with unused parameters, and one more reduction per affected bucket when any rank
        has late gradients; those buckets then wait for all their parameters again.
        """
        if not self.unused or self.s.dp_size == 1:
            return
        if not comm.all_reduce_max_flag(bool(self.late), group=self.dp_group):
            return
        mask = torch.zeros(len(self.order), device=comm.device_for_backend(self.dp_group))
        for k in self.late:
            mask[k] = 1.0
        comm.all_reduce_flags(mask, group=self.dp_group)
        for k in [k for k, flag in enumerate(mask.tolist()) if flag]:
            self._add_late(k, self.late.pop(k, None))
            g, b = self.order[k]
            for i in self.groups[g].plan.buckets[b].params:
                if (g, i) in self.unused:
                    self.unused.discard((g, i))
                    self.expected[k] += 1

    def _add_late(self, k: int, late: torch.Tensor | None) -> None:
        """Reduce bucket k's late gradients (zeros where this rank has none) and add them to the result."""
        g, b = self.order[k]
        grp = self.groups[g]
        bucket = grp.plan.buckets[b]
        n, width = grp.num_partitions, bucket.shard_numel
        send = torch.zeros(n * width, dtype=self.s.comm_dtype, device=grp.device) if late is None \
            else late.to(self.s.comm_dtype)
        pre, post = self._scales()
        send.mul_(pre)
        if n > 1 and self.s.reduce_scatter:
            mine = torch.empty(width, dtype=send.dtype, device=send.device)
            comm.reduce_scatter(mine, send, group=self.dp_group, scratch=True)
        else:
            comm.all_reduce(send, group=self.dp_group)
            mine = send.view(n, width)[grp.rank] if n > 1 else send
        mine = mine.to(self.s.accum_dtype) * post
        if n == 1:
            self._bucket_buffer(g, b).add_(mine)
        else:
            self.partition_buffer(g)[bucket.partition_offset: bucket.partition_offset + width].add_(mine)

    def _launch_ready(self, early: bool = False) -> None:
        while self.next_launch < len(self.order) and self.arrived[self.next_launch] >= self.expected[self.next_launch]:
            self._launch(self.next_launch)
            self.early_launches += int(early)

    # --- collectives -----------------------------------------------------------------------------
    def _scales(self) -> tuple[float, float]:
        n, f = self.s.dp_size, self.s.gradient_predivide_factor
        if self.s.prescale_gradients:
            return 1.0 / n, 1.0
        return 1.0 / f, f / n

    def _launch(self, k: int) -> None:
        if self.heap_trimmer is not None and self.active:
            self.heap_trimmer.trim_if_freed()
        while len(self.pending) >= MAX_IN_FLIGHT:  # bound the buffers held by collectives in flight
            self._complete(self.pending.pop(0))
        g, b = self.order[k]
        self.next_launch = k + 1
        if self.full[g] is None:  # a transient buffer: columns of parameters that sent nothing are still unset
            self._zero_missing(g, b, self._bucket_buffer(g, b))
        if self.s.dp_size == 1:
            self.pending.append(_Pending(g, b, None, self._bucket_buffer(g, b), None))
            return
        if self.allreduce_gate is not None and not self.allreduce_gate():
            assert self.groups[g].num_partitions == 1, "local gradients need one partition (stage 0)"
            self.pending.append(_Pending(g, b, None, self._bucket_buffer(g, b), None, local=True))
            return
        buf = self._bucket_buffer(g, b)
        send = buf if buf.dtype == self.s.comm_dtype else buf.to(self.s.comm_dtype)
        pre, _ = self._scales()
        if pre != 1.0:
            send.mul_(pre)
        grp = self.groups[g]
        if self.s.topk_ratio > 0 and self.topk_steps >= self.s.topk_warmup_steps:
            # every rank gets the dense sum of the sparse parts, as from an all-reduce
            residual = None
            if self.s.topk_error_feedback:
                residual = self.residual.setdefault((g, b), torch.zeros(send.numel(), device=send.device))
            beta1 = self.topk_momentum.get(g)
            if beta1 is not None:  # DGC's momentum correction: u = b1 u + (1 - b1) g on each rank, u is sent
                u = self.velocity.setdefault((g, b), torch.zeros(send.numel(), device=send.device))
                send.copy_(u.mul_(beta1).add_(send, alpha=1 - beta1))
            sent = comm.sparse_all_reduce(send, self.s.topk_ratio, residual, self.dp_group, self.topk_scale.get((g, b)))
            if beta1 is not None:
                u.index_fill_(0, sent, 0.0)  # momentum factor masking: what was sent leaves the momentum too
            self.pending.append(_Pending(g, b, None, send, None))
            return
        if grp.num_partitions == 1 or not self.s.reduce_scatter:
            handle = comm.all_reduce(send, group=self.dp_group, async_op=True)
            self.pending.append(_Pending(g, b, handle, send, None))
        elif self.sink is None and send.dtype == self.s.accum_dtype and self._direct() and self._overwrites(g, b):
            target, _ = self._reduce_target(g, b)  # this rank's chunk lands in the partition: no output buffer
            handle = comm.reduce_scatter(target, send, group=self.dp_group, async_op=True, scratch=True)
            self.pending.append(_Pending(g, b, handle, send, target, direct=True))
        else:
            out, handle = self._reduce_scatter(g, b, send)
            self.pending.append(_Pending(g, b, handle, send, out))

    def _direct(self) -> bool:
        """Whether reduce-scatters may write the partition themselves (not when a subclass reduces its own way)."""
        return True

    def _overwrites(self, g: int, b: int) -> bool:
        """Whether bucket (g, b)'s reduced chunk replaces its partition slice (stage 1, or no reduce wrote it yet)."""
        return self.s.stage < 2 or self.partition[g] is None or b in self.unwritten[g]

    def _reduce_scatter(self, g: int, b: int, send: torch.Tensor) -> tuple[torch.Tensor, comm.Handle | None]:
        """Launch bucket (g, b)'s reduce-scatter: this rank's chunk, and the handle to wait for."""
        out = empty_buffer(self.groups[g].plan.buckets[b].shard_numel, send.dtype, send.device)
        # ``send`` is a transient bucket, or a stage-1 full buffer that is zeroed after the step: Gloo may use it
        return out, comm.reduce_scatter(out, send, group=self.dp_group, async_op=True, scratch=True)

    def _complete(self, item: _Pending) -> None:
        if item.handle is not None:
            item.handle.wait()
        _, post = self._scales()
        grp = self.groups[item.g]
        bucket = grp.plan.buckets[item.b]
        buf = self._bucket_buffer(item.g, item.b)
        if grp.num_partitions == 1 and self.sink is None:
            if item.send is not buf:
                buf.copy_(item.send)
            if post != 1.0 and self.s.dp_size > 1 and not item.local:
                buf.mul_(post)
            return
        if item.out is None:  # all-reduce then keep this rank's chunk
            mine = item.send.view(grp.num_partitions, bucket.shard_numel)[grp.rank]
        else:
            mine = item.out
        scale = post if post != 1.0 and self.s.dp_size > 1 else 1.0
        if item.direct:
            if scale != 1.0:
                item.out.mul_(scale)  # type: ignore[union-attr]
            self._retire(item.g, item.b)
            return
        if self.sink is not None:
            self.sink.add(item.g, bucket.partition_offset, mine * scale if scale != 1.0 else mine)
            self._retire(item.g, item.b)
            return
        target, fresh = self._reduce_target(item.g, item.b)
        if self.s.stage >= 2 and not fresh:
            target.add_(mine, alpha=scale)  # one pass: no scaled temporary
        elif scale != 1.0:
            torch.mul(mine, scale, out=target)
        else:
            target.copy_(mine)
        if self.full[item.g] is None:
            self._retire(item.g, item.b)

    # --- micro-step protocol (called by the engine) -----------------------------------------------
    def begin_micro_step(self, communicate: bool) -> None:
        """``communicate``: reduce on this micro-step (stage 2: always; stages 0-1: the boundary)."""
        if self.s.local_accumulation and self.s.stage == 2 and not communicate and not self.accumulates_locally:
            self._make_full_buffers()
        self.communicate = communicate or (self.s.stage >= 2 and not self.accumulates_locally)
        self.boundary = communicate
        self.active = True
        self.got = set()
        if self.communicate and self.s.overlap_comm:
            self._launch_ready()  # buckets of unused parameters only

    def _make_full_buffers(self) -> None:
        """Stage 2, local accumulation: stage 1's full-size buffers, made once, between micro-steps."""
        assert not self.pending and not self.staging, "full buffers are made between micro-steps"
        for g, grp in enumerate(self.groups):
            if self.full[g] is None:
                self.full[g] = torch.zeros(grp.plan.padded_numel, dtype=self.s.accum_dtype, device=grp.device)
        self.accumulates_locally = True

    @torch.no_grad()
    def end_micro_step(self) -> None:
        """After backward: launch what is left (in order), wait for everything, reset counters."""
        self.active = False
        if self.unused is None:
            self._learn_unused()
        self.window_got |= self.got
        if self.communicate:
            while self.next_launch < len(self.order):
                self._launch(self.next_launch)
            for item in self.pending:
                self._complete(item)
            self.pending.clear()
            self.spare.clear()
            self.next_launch = 0
            if self.sink is not None:
                self.sink.end_micro_step()
        self.arrived = [0] * len(self.order)
        if self.boundary and not self.ignore_unused_parameters and self.s.stage in (1, 2):
            self._check_all_used()

    def _check_all_used(self) -> None:
        """``ignore_unused_parameters: false`` (DeepSpeed's stages 1-2): every trainable parameter had a gradient."""
        missing = [self._name(g, i) for g, grp in enumerate(self.groups) for i in range(len(grp.params))
                   if (g, i) not in self.window_got]
        if missing:
            raise RuntimeError(
                f"{len(missing)} trainable parameter(s) got no gradient in this step: {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}. Make every trainable parameter and forward output take part "
                "in the loss, or set zero_optimization.ignore_unused_parameters to true (DeepSpeed's default).")

    def release_in_flight(self) -> None:
        """After an error, before the group is dropped: let go of the collectives in flight (not waited for).

        Their buffers may still be written until the group's backend has finished them, which dropping it
        waits for; only then may :meth:`reset` zero those buffers.
        """
        self.pending.clear()

    @torch.no_grad()
    def reset(self) -> None:
        """After an error in forward, backward or step (and the group dropped): forget the step's gradients.

        Every gradient accumulated in this window is zeroed, so the next step starts clean.
        """
        self.pending.clear()
        self.next_launch = 0
        self.arrived = [0] * len(self.order)
        self.active = False
        self.got = set()
        for p in self.where:
            p.grad = None
        self.zero()
        self.late.clear()

    @torch.no_grad()
    def zero(self) -> None:
        """After the optimizer step: clear accumulated gradients for the next step."""
        for full in self.full:
            if full is not None:
                full.zero_()
        # Released, not zeroed: the partition comes back (zeros) at the first reduce of the next backward, so it
        # is not held through the forward and the start of backward, where a step's activations peak.
        self.partition = [None] * len(self.partition)
        self.unwritten = [set() for _ in self.partition]
        self.staging.clear()
        self.spare.clear()
        self.late.clear()
        self.window_got = set()
        if self.sink is not None:
            self.sink.zero()

    def grad_bytes(self) -> int:
        """Gradient bytes; a stage-2/3 partition counts at its size also while released between steps."""
        total = 0
        for t in [*self.full, *self.partition, *self.staging.values()]:
            if t is not None:
                total += t.numel() * t.element_size()
        if self.s.stage >= 2 and not self.s.partition_sink:
            size = torch.empty((), dtype=self.s.accum_dtype).element_size()
            total += sum(grp.plan.partition_numel * size for g, grp in enumerate(self.groups)
                         if grp.num_partitions > 1 and self.partition[g] is None)
        return total + (self.sink.host_bytes() if self.sink is not None else 0)

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
