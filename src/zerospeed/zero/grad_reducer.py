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

Unused parameters: a parameter that got no gradient in the first backward is from then on treated as
arrived, so its bucket (and every bucket after it, launched in order) does not wait for the end of
backward. Ranks that used different parameters still issue identical collectives (same buckets, same
order; only the timing differs). Should such a parameter get a gradient later after its bucket was
reduced, that gradient cannot be included any more: the backward raises (the step is abandoned on every
rank, see ``runtime/engine.py``) and the parameter is waited for again from then on. At most
``MAX_IN_FLIGHT`` buckets are in flight: launching one more first completes the oldest, so stage 2's
transient bucket buffers stay bounded (about two buckets) instead of adding up to the whole model.

Gradients that arrive outside this reducer's own micro-step (another engine's backward reaching these
parameters, e.g. a GAN generator's loss through the discriminator) are left in ``p.grad`` for the user's
``zero_grad()``, as in plain PyTorch; stage 3 cannot keep a full gradient beside a partitioned parameter
and raises instead.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class _Pending:
    def __init__(self, g: int, b: int, handle: comm.Handle | None, send: torch.Tensor, out: torch.Tensor | None) -> None:
        self.g, self.b, self.handle, self.send, self.out = g, b, handle, send, out


class GradReducer:
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
            if settings.stage < 2 or g.num_partitions == 1 else None
            for g in groups
        ]
        self.staging: dict[tuple[int, int], torch.Tensor] = {}
        # This rank's reduced gradient partition, in the accumulation dtype.
        self.partition: list[torch.Tensor | None] = [None] * len(groups)
        self.where: dict[nn.Parameter, tuple[int, int]] = {}
        self.active = False  # inside this engine's backward (begin_micro_step .. end_micro_step)
        self.got: set[tuple[int, int]] = set()  # (group, index) that got a gradient in this backward
        self.window_got: set[tuple[int, int]] = set()  # ... since the last zero() (the accumulation window)
        self.unused: set[tuple[int, int]] | None = None  # learned from the first backward
        self.boundary = True
        self.ignore_unused_parameters = True  # zero_optimization.ignore_unused_parameters (stages 1-2)
        self.names: dict[nn.Parameter, str] = {}  # for messages (set by build.py)
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
        if buf is None:
            buf = torch.zeros(n * bucket.shard_numel, dtype=self.s.accum_dtype, device=grp.device)
            self.staging[(g, b)] = buf
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.grad_bytes())
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
        if self.unused is not None and (g, i) in self.unused:
            self.unused.discard((g, i))  # used after all: wait for it again from now on
            self.expected[k] += 1
            if self.communicate and k < self.next_launch:
                raise RuntimeError(
                    f"{self._name(g, i)} got no gradient in the first backward, so its gradient bucket no longer "
                    "waits for it, and now got one after that bucket was reduced: its gradient cannot be "
                    "included. This step is abandoned on every rank; from now on the bucket waits for it again.")
        buf = self._bucket_buffer(g, slot.bucket)
        bucket = grp.plan.buckets[slot.bucket]
        scatter_into(buf.view(grp.num_partitions, bucket.shard_numel), slot.offset, slot.shard,
                     grad.reshape(-1), accumulate=True)
        p.grad = None
        self.got.add((g, i))
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
        """After the first backward: parameters that got no gradient count as arrived from now on."""
        self.unused = set()
        for g, grp in enumerate(self.groups):
            for i, slot in enumerate(grp.plan.slots):
                if (g, i) not in self.got:
                    self.unused.add((g, i))
                    self.expected[self.position[(g, slot.bucket)]] -= 1

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
        if grp.num_partitions == 1:
            if item.send is not buf:
                buf.copy_(item.send)
            if post != 1.0 and self.s.dp_size > 1:
                buf.mul_(post)
            return
        if item.out is None:  # all-reduce then keep this rank's chunk
            mine = item.send.view(grp.num_partitions, bucket.shard_numel)[grp.rank]
        else:
            mine = item.out
        target = self.partition_buffer(item.g)[bucket.partition_offset: bucket.partition_offset + bucket.shard_numel]
        if post != 1.0 and self.s.dp_size > 1:
            mine = mine * post
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
        self.boundary = communicate
        self.active = True
        self.got = set()
        if self.communicate and self.s.overlap_comm:
            self._launch_ready()  # buckets of unused parameters only

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
            self.next_launch = 0
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

    @torch.no_grad()
    def reset(self) -> None:
        """After an error in forward, backward or step: forget the step's gradients and collectives in flight.

        The collectives are not waited for (their group is being dropped); every gradient accumulated in
        this window is zeroed, so the next step starts clean.
        """
        self.pending.clear()
        self.next_launch = 0
        self.arrived = [0] * len(self.order)
        self.active = False
        self.got = set()
        for p in self.where:
            p.grad = None
        self.zero()

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
        self.window_got = set()

    def grad_bytes(self) -> int:
        total = 0
        for t in [*self.full, *self.partition, *self.staging.values()]:
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
