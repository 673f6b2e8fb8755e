"""Gradient reduction from backward hooks, in buckets, overlapped with the rest of backward.

Each gradient, as soon as autograd has accumulated it, is moved into its column block of a rank-major
bucket (``bucket_store.py``) and ``p.grad`` is freed. When every gradient of a bucket has arrived
(``arrival.py``) on a micro-step that communicates, its collective is launched asynchronously, always in
bucket order (every rank issues the same sequence), over the group's own process group: an all-reduce for
a single partition (or without ``reduce_scatter``), else a reduce-scatter whose chunk goes to the
destination (``grad_dest.py``: the gradient partition, or the offload sink); the compressor
(``grad_compressor.py``: top-k) may take the bucket instead. At most ``MAX_IN_FLIGHT`` are in flight.
What the stage changes is the choice of parts (``reducer_parts.py``); unused parameters: ``late_grads.py``.
Gradients from outside this reducer's micro-step (another engine's backward) stay in ``p.grad``, as in plain
PyTorch (stage 3 raises, unless its ``adopter`` opens a micro-step: runtime/torch_backward.py). Consumers use
``owned_tensors()``, ``grad_block(p)``, ``partition_buffer(g)``, ``full_buffer(g)`` and ``events.subscribe``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
import torch
from torch import nn

from .. import comm
from ..accelerator.huge_pages import empty_buffer
from .arrival import ArrivalTracker
from .in_flight import MAX_IN_FLIGHT, InFlight
from .layout import scatter_into
from .reducer_events import ReducerEvents
from .late_grads import LateGrads
from .reducer_parts import GroupAxes, ReducerParts, ReducerWiring, ReduceSettings, ShardAxis, reducer_parts, scales
from .sharded_group import ShardedGroup

__all__ = ["GradReducer", "MAX_IN_FLIGHT", "ReducerParts", "ReducerWiring", "ReduceSettings", "ShardAxis"]

class GradReducer:
    def __init__(self, groups: list[ShardedGroup], settings: ReduceSettings, dp_group: comm.Group | None,
                 wiring: ReducerWiring | None = None) -> None:
        w = ReducerWiring() if wiring is None else wiring
        self.parts = w.parts or reducer_parts(groups, settings, w.sink, None, w.ignore_unused_parameters)
        self.store, self.dest, self.compressor = self.parts.store, self.parts.dest, self.parts.compressor
        self.groups, self.s, self.dp_group = groups, settings, dp_group
        self.sink, self.heap_trimmer, self.allreduce_gate, self.names = w.sink, w.heap_trimmer, w.allreduce_gate, w.names
        self.axes = GroupAxes(list(w.axes) if w.axes is not None else [None] * len(groups), dp_group, settings.dp_size)
        self.comm_of = self.axes.comm_of
        self.tracker = ArrivalTracker([[bk.params for bk in grp.plan.buckets] for grp in groups], self.axes.order())
        self.late = LateGrads(groups, settings, self.axes, self.tracker, self.store, self.dest)
        self.events = ReducerEvents()
        self.pending: list[InFlight] = []
        self.communicate = self.boundary = True
        self.active = False  # inside this engine's backward (begin_micro_step .. end_micro_step)
        # adopter: may open a micro-step for a gradient arriving outside one (stage 3, runtime/torch_backward.py);
        # grad_scale multiplies each p.grad taken (its loss factor); scope wraps the take (the engine's comms logger)
        self.adopter: Callable[[], bool] | None = None
        self.grad_scale = 1.0
        self.scope: Callable[[], AbstractContextManager[None]] = nullcontext
        self.where: dict[nn.Parameter, tuple[int, int]] = {}
        self.hooks = []
        for g, grp in enumerate(groups):
            for i, p in enumerate(grp.params):
                self.where[p] = (g, i)
                self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # --- public surface ----------------------------------------------------------------------------
    def partition_buffer(self, g: int) -> torch.Tensor:
        """The reduced gradient partition of group g (accumulation dtype)."""
        with self.events.span(None, "grad_partitions"):
            if self.groups[g].num_partitions == 1:
                full = self.store.full[g]
                assert full is not None, "a single partition always has a full gradient buffer"
                return full
            return self.dest.buffer(g)

    def full_buffer(self, g: int) -> torch.Tensor | None:
        """Group g's full-size gradient buffer (None: transient buckets), spent once reduced."""
        return self.store.full[g]

    def grad_block(self, p: nn.Parameter) -> torch.Tensor | None:
        """``p``'s columns of its bucket (``[num_partitions, shard]``): its accumulated gradient (None: frozen)."""
        if p not in self.where:
            return None
        (g, i), grp = self.where[p], self.groups[self.where[p][0]]
        slot = grp.plan.slots[i]
        self.store.clean_block(g, i, self.tracker.got, self.tracker.window_got)
        view = self.store.bucket(g, slot.bucket).view(grp.num_partitions, grp.plan.buckets[slot.bucket].shard_numel)
        return view[:, slot.offset:slot.offset + slot.shard]

    def owned_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(owner, tensor) for every buffer the reducer holds now: ``grad_buckets``, ``grad_partitions``."""
        for t in [*self.store.tensors(), *self.late.buffers.values(),
                  *(t for item in self.pending for t in (item.send, item.out) if t is not None)]:
            yield "grad_buckets", t
        for t in self.dest.tensors():
            yield "grad_partitions", t

    def grad_bytes(self) -> int:
        """Gradient bytes; a stage-2/3 partition counts at its size also while released between steps."""
        return sum(t.numel() * t.element_size() for t in self.store.tensors()) + self.dest.bytes()

    # --- hooks -------------------------------------------------------------------------------------
    def _name(self, g: int, i: int) -> str:
        p = self.groups[g].params[i]
        return self.names.get(p, f"parameter {i} of group {g} ({self.groups[g].plan.slots[i].numel} elements)")

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if not self.active and not (self.adopter is not None and self.adopter()):
            return self._outside_backward(*self.where[p])  # type: ignore[index]
        with self.scope():
            self.take_p_grad(p)  # type: ignore[arg-type]

    @torch.no_grad()
    def take_p_grad(self, p: nn.Parameter) -> None:
        """Inside a micro-step: take ``p.grad`` (times ``grad_scale``) into its bucket and free it, as its hook does."""
        g, i, grad = *self.where[p], p.grad
        assert self.active and grad is not None
        with self.events.span(None, "grad_buckets"):
            self._take(g, i, grad if self.grad_scale == 1.0 else grad.mul_(self.grad_scale))
            p.grad = None
            self._arrived(g, i)

    @torch.no_grad()
    def take_grad(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """``p``'s gradient handed over directly, not through ``p.grad`` (DeepCompile's graph op: the full gradient
        of a partitioned parameter, whose ``p.grad`` could not hold it)."""
        g, i = self.where[p]
        if not self.active:
            self._outside_backward(g, i)
            return
        with self.events.span(None, "grad_buckets"):
            self._take(g, i, grad)
            self._arrived(g, i)

    def _arrived(self, g: int, i: int) -> None:
        if self.tracker.take((g, i)) and self.communicate and self.s.overlap_comm:
            self._launch_ready()

    def _take(self, g: int, i: int, grad: torch.Tensor) -> None:
        """Copy (or add) ``grad`` into its bucket's columns, or into the late buffer of a launched bucket."""
        grp, key = self.groups[g], (g, i)
        slot = grp.plan.slots[i]
        width = grp.plan.buckets[slot.bucket].shard_numel
        late = self.tracker.is_unused(key) and self.communicate and self.tracker.launched(key) and self.comm_of[g][1] > 1
        buf = self.late.buffer(self.tracker.bucket_of[key]) if late else self.store.bucket(g, slot.bucket)
        first = not late and self.store.uninitialised(g, key, self.tracker.got, self.tracker.window_got)
        grad = grad.to_dense() if grad.is_sparse else grad  # nn.Embedding(sparse=True)
        scatter_into(buf.view(grp.num_partitions, width), slot.offset, slot.shard, grad.reshape(-1), accumulate=not first)

    def _outside_backward(self, g: int, i: int) -> None:
        """A gradient from someone else's backward: leave it in ``p.grad``, or refuse where it cannot be kept."""
        if self.parts.keeps_foreign_grads:
            return
        self.groups[g].params[i].grad = None
        raise RuntimeError(
            f"a gradient for {self._name(g, i)} arrived outside this engine's backward() (another engine's "
            "backward reached its parameters, e.g. a GAN generator loss through the discriminator). Under "
            "ZeRO stage 3 the parameter is partitioned, so its full gradient cannot be kept in p.grad: stop "
            "the gradient (detach, or requires_grad_(False) on these parameters for that backward), or use "
            "stage 0-2, where such gradients stay in p.grad as in plain PyTorch.")

    @torch.no_grad()
    def settle_late(self) -> None:
        """Before the optimizer step: add in gradients that arrived after their bucket left (``late_grads.py``)."""
        with self.events.span("reduce", "grad_buckets"):
            self.late.settle()

    # --- collectives -------------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        while (k := self.tracker.pop_ready()) is not None:
            self._launch(k)

    def _launch(self, k: int) -> None:
        with self.events.span("reduce", "grad_buckets"):
            if self.heap_trimmer is not None and self.active:
                self.heap_trimmer.trim_if_freed()
            while len(self.pending) >= MAX_IN_FLIGHT:  # bound the buffers held by collectives in flight
                self._complete(self.pending.pop(0))
            g, b = self.tracker.order[k]
            grp, (group, size) = self.groups[g], self.comm_of[g]
            self.store.zero_missing(g, b, self.tracker.got, self.tracker.window_got)  # columns with no value
            buf = self.store.bucket(g, b)
            if size == 1 or (self.allreduce_gate is not None and not self.allreduce_gate()):
                assert size == 1 or grp.num_partitions == 1, "local gradients need one partition (stage 0)"
                self.pending.append(InFlight(g, b, None, buf, None, local=True))
                return
            dtype = self.store.comm_dtype(g, b)
            send = buf if buf.dtype == dtype else buf.to(dtype)
            pre, _ = scales(self.s, size)
            if pre != 1.0:
                send.mul_(pre)
            out, handle, direct = None, None, False
            if self.compressor.takes((g, b)):  # every rank gets the dense sum of the sparse parts, as from an all-reduce
                self.compressor.all_reduce((g, b), send, group)
            elif grp.num_partitions == 1 or not self.s.reduce_scatter:
                handle = comm.all_reduce(send, group=group, async_op=True)
            else:
                out = self.dest.direct(g, b, self.store.holds_window) \
                    if send.dtype == self.s.accum_dtype and self._direct() else None
                if out is not None:  # this rank's chunk lands in the partition: no output buffer
                    handle, direct = comm.reduce_scatter(out, send, group=group, async_op=True, scratch=True), True
                else:
                    out, handle = self._reduce_scatter(g, b, send)
            self.pending.append(InFlight(g, b, handle, send, out, direct=direct))

    def _direct(self) -> bool:
        """Whether reduce-scatters may write the partition themselves (not when a subclass reduces its own way)."""
        return True

    def _reduce_scatter(self, g: int, b: int, send: torch.Tensor) -> tuple[torch.Tensor, comm.Handle | None]:
        """Launch bucket (g, b)'s reduce-scatter: this rank's chunk, and the handle to wait for."""
        out = empty_buffer(self.groups[g].plan.buckets[b].shard_numel, send.dtype, send.device)
        # ``send`` is a transient bucket, or a stage-1 full buffer that is zeroed after the step: Gloo may use it
        return out, comm.reduce_scatter(out, send, group=self.comm_of[g][0], async_op=True, scratch=True)

    def _complete(self, item: InFlight) -> None:
        with self.events.span("reduce", "grad_buckets"):
            if item.handle is not None:
                item.handle.wait()
            grp = self.groups[item.g]
            scale = 1.0 if item.local else scales(self.s, self.comm_of[item.g][1])[1]
            if grp.num_partitions == 1 and self.dest.in_place:
                buf = self.store.bucket(item.g, item.b)
                if item.send is not buf:
                    buf.copy_(item.send)
                if scale != 1.0:
                    buf.mul_(scale)
                return
            mine = item.out if item.out is not None else item.send.view(grp.num_partitions, -1)[grp.rank]
            if item.direct:
                if scale != 1.0:
                    mine.mul_(scale)
            else:
                self.dest.put(item.g, item.b, mine, scale, self.store.holds_window)
            self.store.retire(item.g, item.b)

    # --- micro-step protocol (called by the engine) --------------------------------------------------
    def begin_micro_step(self, communicate: bool) -> None:
        """``communicate``: this micro-step ends an accumulation window (the store may reduce more often)."""
        self.communicate = self.store.begin(communicate)
        self.boundary = communicate
        self.active = True
        self.tracker.begin()
        if self.communicate and self.s.overlap_comm:
            self._launch_ready()  # buckets of unused parameters only

    def flush(self) -> None:
        """Reduce what the store holds, as a micro-step without gradients (the caller's accumulation boundary:
        ``managed_gradient_accumulation: false``, the end of ``coalesce_grad_reduction``)."""
        if self.tracker.unused is not None and (self.store.holds_window or self.store.holding):
            self.begin_micro_step(True)
            self.end_micro_step()
        self.store.release()

    @torch.no_grad()
    def end_micro_step(self) -> None:
        """After backward: launch what is left (in order), wait for everything, reset counters."""
        with self.events.span("reduce", "grad_buckets"):
            self.active = False
            if self.tracker.unused is None:
                self.late.learn_unused()
            if self.communicate:
                while (k := self.tracker.pop_next()) is not None:
                    self._launch(k)
                for item in self.pending:
                    self._complete(item)
                self.pending.clear()
                self.store.end_micro_step()
                self.dest.end_micro_step()
            self.tracker.end_micro_step(relaunch=self.communicate)
            if self.boundary and self.parts.checks_all_used:
                self.late.check_all_used(self._name)

    def release_in_flight(self) -> None:
        """After an error, before the group is dropped: let go of the collectives in flight (not waited for);
        their buffers may be written until the backend has finished them, so only then may :meth:`reset` run."""
        self.pending.clear()

    @torch.no_grad()
    def reset(self) -> None:
        """After an error in forward, backward or step (and the group dropped): forget the step's gradients."""
        self.pending.clear()
        self.tracker.reset()
        self.active = False
        for p in self.where:
            p.grad = None
        self.zero()

    @torch.no_grad()
    def zero(self) -> None:
        """After the optimizer step: clear accumulated gradients for the next step (partitions released)."""
        self.store.zero()
        self.dest.zero()
        self.late.clear()
        self.tracker.zero()

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
