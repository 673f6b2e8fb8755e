"""Gradient reduction from backward hooks, in buckets, overlapped with the rest of backward.

Each parameter's gradient is moved, as soon as autograd has accumulated it, into its column block
of a rank-major bucket buffer (see ``partition``) and the parameter's own ``.grad`` is freed. When
every gradient of a bucket has arrived (on a micro-step that communicates), the bucket's collective
is launched asynchronously, always in bucket order so every rank issues the same sequence:

* stage 0: all-reduce the bucket (one partition: every rank keeps the full averaged gradient);
* stage 1: gradients accumulate locally in full-size buffers; on the accumulation boundary each
  bucket is reduce-scattered into this rank's fp32 gradient partition;
* stage 2: no full-size buffer: every micro-step reduce-scatters a transient bucket buffer and adds
  the result into the gradient partition.

Buckets whose parameters got no gradient (unused in this forward) are launched at the end of
backward, so ranks that used different parameters still issue identical collectives. At most
``MAX_IN_FLIGHT`` buckets are in flight: launching one more first completes the oldest, so stage 2's
transient bucket buffers stay bounded (about two buckets) instead of adding up to the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import comm
from .layout import scatter_into
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
    # No gradient partition buffer: each bucket's reduced slice goes to ``GradReducer.sink`` (offload/grad_sink.py:
    # NVMe offload at stages 2-3 streams it to the swap files; CPU offload on an accelerator to host memory).
    partition_sink: bool = False


class _Pending:
    def __init__(self, g: int, b: int, handle: comm.Handle | None, send: torch.Tensor, out: torch.Tensor | None) -> None:
        self.g, self.b, self.handle, self.send, self.out = g, b, handle, send, out


class GradReducer:
    # Where reduced slices go under ``settings.partition_sink`` (``add(g, partition_offset, values)``,
    # ``end_micro_step()``, ``zero()``); set before the first backward.
    sink: Any = None

    def __init__(self, groups: list[ShardedGroup], settings: ReduceSettings, dp_group: comm.Group | None) -> None:
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
        dev = groups[0].device if groups else torch.device("cpu")
        # Full-size accumulation buffers (stages 0 and 1, or a single partition) or transient per-bucket
        # ones (stage 2).
        self.full: list[torch.Tensor | None] = [
            torch.zeros(g.plan.padded_numel, dtype=settings.accum_dtype, device=dev)
            if settings.stage < 2 or (g.num_partitions == 1 and not settings.partition_sink) else None
            for g in groups
        ]
        self.staging: dict[tuple[int, int], torch.Tensor] = {}
        # This rank's reduced gradient partition, in the accumulation dtype.
        self.partition: list[torch.Tensor | None] = [None] * len(groups)
        self.where: dict[nn.Parameter, tuple[int, int]] = {}
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
        if buf is None:
            buf = torch.zeros(n * bucket.shard_numel, dtype=self.s.accum_dtype, device=grp.device)
            self.staging[(g, b)] = buf
        return buf

    def partition_buffer(self, g: int) -> torch.Tensor:
        """The reduced gradient partition of group g (accumulation dtype)."""
        grp = self.groups[g]
        if grp.num_partitions == 1:
            full = self.full[g]
            assert full is not None, "a single partition always has a full gradient buffer"
            return full
        part = self.partition[g]
        if part is None:
            part = torch.zeros(grp.plan.partition_numel, dtype=self.s.accum_dtype, device=grp.device)
            self.partition[g] = part
        return part

    # --- hooks -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        g, i = self.where[p]  # type: ignore[index]
        grp = self.groups[g]
        slot = grp.plan.slots[i]
        grad = p.grad
        if grad is None:
            return
        buf = self._bucket_buffer(g, slot.bucket)
        bucket = grp.plan.buckets[slot.bucket]
        scatter_into(buf.view(grp.num_partitions, bucket.shard_numel), slot.offset, slot.shard,
                     grad.reshape(-1), accumulate=True)
        p.grad = None
        k = self.position[(g, slot.bucket)]
        self.arrived[k] += 1
        if self.communicate and self.s.overlap_comm and self.arrived[k] == self.expected[k]:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.order) and self.arrived[self.next_launch] >= self.expected[self.next_launch]:
            self._launch(self.next_launch)

    # --- collectives -----------------------------------------------------------------------------
    def _scales(self) -> tuple[float, float]:
        n, f = self.s.dp_size, self.s.gradient_predivide_factor
        if self.s.prescale_gradients:
            return 1.0 / n, 1.0
        return 1.0 / f, f / n

    def _launch(self, k: int) -> None:
        while len(self.pending) >= MAX_IN_FLIGHT:  # bound the buffers held by collectives in flight
            self._complete(self.pending.pop(0))
        g, b = self.order[k]
        self.next_launch = k + 1
        if self.s.dp_size == 1:
            self.pending.append(_Pending(g, b, None, self._bucket_buffer(g, b), None))
            return
        buf = self._bucket_buffer(g, b)
        send = buf if buf.dtype == self.s.comm_dtype else buf.to(self.s.comm_dtype)
        pre, _ = self._scales()
        if pre != 1.0:
            send.mul_(pre)
        grp = self.groups[g]
        if grp.num_partitions == 1 or not self.s.reduce_scatter:
            handle = comm.all_reduce(send, group=self.dp_group, async_op=True)
            self.pending.append(_Pending(g, b, handle, send, None))
        else:
            out = torch.empty(grp.plan.buckets[b].shard_numel, dtype=send.dtype, device=send.device)
            handle = comm.reduce_scatter(out, send, group=self.dp_group, async_op=True)
            self.pending.append(_Pending(g, b, handle, send, out))

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
            if post != 1.0 and self.s.dp_size > 1:
                buf.mul_(post)
            return
        if item.out is None:  # all-reduce then keep this rank's chunk
            mine = item.send.view(grp.num_partitions, bucket.shard_numel)[grp.rank]
        else:
            mine = item.out
        if post != 1.0 and self.s.dp_size > 1:
            mine = mine * post
        if self.sink is not None:
            self.sink.add(item.g, bucket.partition_offset, mine)
            self.staging.pop((item.g, item.b), None)
            return
        target = self.partition_buffer(item.g)[bucket.partition_offset: bucket.partition_offset + bucket.shard_numel]
        if self.s.stage >= 2:
            target.add_(mine)
        else:
            target.copy_(mine)
        if self.full[item.g] is None:
            self.staging.pop((item.g, item.b), None)

    # --- micro-step protocol (called by the engine) -----------------------------------------------
    def begin_micro_step(self, communicate: bool) -> None:
        """``communicate``: reduce on this micro-step (stage 2: always; stages 0-1: the boundary)."""
        self.communicate = communicate or self.s.stage >= 2

    @torch.no_grad()
    def end_micro_step(self) -> None:
        """After backward: launch what is left (in order), wait for everything, reset counters."""
        if self.communicate:
            while self.next_launch < len(self.order):
                self._launch(self.next_launch)
            for item in self.pending:
                self._complete(item)
            self.pending.clear()
            self.next_launch = 0
            if self.sink is not None:
                self.sink.end_micro_step()
        self.arrived = [0] * len(self.order)

    @torch.no_grad()
    def zero(self) -> None:
        """After the optimizer step: clear accumulated gradients for the next step."""
        for full in self.full:
            if full is not None:
                full.zero_()
        for g, part in enumerate(self.partition):
            if part is None:
                continue
            if self.s.stage == 1:
                self.partition[g] = None  # stage 1 keeps full gradients; the partition is transient
            else:
                part.zero_()
        self.staging.clear()
        if self.sink is not None:
            self.sink.zero()

    def grad_bytes(self) -> int:
        total = 0
        for t in [*self.full, *self.partition, *self.staging.values()]:
            if t is not None:
                total += t.numel() * t.element_size()
        return total + (self.sink.host_bytes() if self.sink is not None else 0)

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
