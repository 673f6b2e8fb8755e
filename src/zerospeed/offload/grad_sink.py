"""Where the reduced gradients go when not into a device partition buffer (the reducer's ``sink``).

``HostGrads`` (CPU offload on an accelerator): host partitions, filled by side-stream copies (its docstring).
``SwappedGrads`` (NVMe offload, stages 2-3): the swap files, with no fp32 gradient partition in host memory.

Under ``offload_optimizer.device: nvme`` each sub-group's swap file has one more region after the optimizer
state (and master), ``grad``. The reducer hands every completed bucket's slice of this rank's reduced
gradient (partition coordinates ``[lo, lo + n)``) to :meth:`SwappedGrads.add`; the slice is added into an
aligned fp32 buffer of the sub-group it falls in. Buckets complete in partition order (backward order), so
once every element of a sub-group has arrived its buffer is written to the region (``O_DIRECT``, in the
background, at most ``MAX_WRITES`` writes held) and released: about two sub-groups of gradient are resident
at a time instead of the whole partition. A later micro-step of the same step (gradient accumulation)
first reads the region back and adds to it. Each write records the sub-group's sum of squares and whether
it is finite, so the optimizer gets the global norm and the overflow flag without the gradients; the
unscale/clip multiplier it computes is kept in :attr:`SwappedGrads.scale` and applied by the stepper when
it reads the region with the state (``stepper.py``).

A read or write that fails during backward does not raise there (a rank raising inside backward would
leave the others waiting in a collective): the first error is kept in :attr:`SwappedGrads.error`, further
gradient I/O stops, and the stepper raises it at the step, where every rank learns of it.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from .state_store import state_layout
from .subgroups import SubGroup
from .swapper import AsyncSwapper, Handle, OffloadIOError, aligned_empty
from ..accelerator import can_pin_memory
from ..zero.squares import sum_of_squares

GRAD = "grad"
MAX_WRITES = 2  # gradient writes in flight (each holds one sub-group buffer)


class SwappedGrads:
    """This rank's gradient partition, sub-group by sub-group, in the ``grad`` regions of the swap files."""

    resident = False  # the optimizer gets no gradient tensors: norm, flags and scale go through the sink

    MAX_COPIES = 4  # device-to-host copies outstanding (accelerator only)

    def __init__(self, subgroups: list[list[SubGroup]], keys: list[tuple[str, ...]], swapper: AsyncSwapper,
                 ensure: Callable[[SubGroup], None], accelerator: Any = None, pin: bool = False) -> None:
        self.subgroups, self.keys = subgroups, keys
        # On an accelerator, slices leave the device on a side stream (pinned if asked) and are added here in
        # arrival order once they have landed; on the CPU they are added at once.
        self.acc, self.pin = accelerator, pin
        self.stream = None if accelerator is None else accelerator.side_stream()
        self.copies: deque[tuple[int, int, torch.Tensor, Any]] = deque()
        # Weak: the model's gradient hooks hold the reducer, which holds this sink; the swap files must still
        # go away with the engine (as for ``SwappedMaster``).
        self._swapper = weakref.ref(swapper)
        self._ensure: Callable[[], Callable[[SubGroup], None] | None] = (
            weakref.WeakMethod(ensure) if hasattr(ensure, "__self__") else lambda: ensure)  # type: ignore[arg-type]
        self.open: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}  # buffer, elements added this micro-step
        self.writes: deque[tuple[Handle, torch.Tensor]] = deque()
        self.held: set[tuple[int, int]] = set()  # sub-groups whose region holds this step's gradient
        self.sq: dict[tuple[int, int], torch.Tensor] = {}
        self.finite: dict[tuple[int, int], bool] = {}
        self.scale = 1.0  # unscale x clip multiplier of this step, applied by the stepper
        self.error: BaseException | None = None  # the first I/O failure, raised by the stepper at the step

    @property
    def swapper(self) -> AsyncSwapper:
        sw = self._swapper()
        if sw is None:
            raise RuntimeError("the offloaded gradients are gone: their swap files were removed with the engine")
        return sw

    def ensure(self, sg: SubGroup) -> None:
        fn = self._ensure()
        if fn is None:
            raise RuntimeError("the offloaded optimizer state is gone: it was removed with the engine")
        fn(sg)

    def offset(self, sg: SubGroup) -> int:
        return state_layout(sg, self.keys[sg.gi])[1][GRAD]

    def holds(self, sg: SubGroup) -> bool:
        return (sg.gi, sg.index) in self.held

    # --- from the reducer ----------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, gi: int, lo: int, values: torch.Tensor) -> None:
        """Add this rank's reduced gradient of partition elements ``[lo, lo + values.numel())``."""
        if self.error is not None:
            return
        try:
            if self.acc is None:
                self._add(gi, lo, values.reshape(-1))
                return
            host, done = self.acc.copy_to_host(values.reshape(-1), self.pin, self.stream)
            self.copies.append((gi, lo, host, done))
            while len(self.copies) > self.MAX_COPIES:
                self._land()
        except (OffloadIOError, OSError) as exc:
            self.error = exc

    def _land(self) -> None:
        gi, lo, host, done = self.copies.popleft()
        done.synchronize()
        self._add(gi, lo, host)

    def _add(self, gi: int, lo: int, values: torch.Tensor) -> None:
        hi = lo + values.numel()
        for sg in self.subgroups[gi]:
            x, y = max(lo, sg.lo), min(hi, sg.hi)
            if x >= y:
                continue
            key = (gi, sg.index)
            buf, filled = self.open[key] if key in self.open else (self._start(sg), 0)
            buf[x - sg.lo:y - sg.lo].add_(values[x - lo:y - lo].to(device="cpu", dtype=torch.float32))
            filled += y - x
            if filled >= sg.numel:
                self.open.pop(key, None)
                self._flush(sg, buf)
            else:
                self.open[key] = (buf, filled)

    def _start(self, sg: SubGroup) -> torch.Tensor:
        buf = aligned_empty(sg.numel * 4)[: sg.numel * 4].view(torch.float32)
        if self.holds(sg):  # an earlier micro-step of this step wrote it: accumulate onto it
            self.swapper.read(sg.name, buf, offset=self.offset(sg)).wait()
        else:
            buf.zero_()
        return buf

    def _flush(self, sg: SubGroup, buf: torch.Tensor) -> None:
        key = (sg.gi, sg.index)
        self.sq[key] = sum_of_squares(buf)
        self.finite[key] = bool(torch.isfinite(buf).all())
        self.ensure(sg)
        self.writes.append((self.swapper.write(sg.name, buf, offset=self.offset(sg)), buf))
        self.held.add(key)
        while len(self.writes) > MAX_WRITES:
            self.writes.popleft()[0].wait()  # a failure propagates to ``add``, which keeps it

    def end_micro_step(self) -> None:
        """Write what is still open (elements that got nothing keep their value) and wait for every write."""
        try:
            while self.copies and self.error is None:
                self._land()
            if self.error is None:
                for (gi, index), (buf, _) in list(self.open.items()):
                    self._flush(self.subgroups[gi][index], buf)
        except (OffloadIOError, OSError) as exc:
            self.error = exc
        self.open.clear()
        while self.copies:  # after a failure: let nothing in flight land in a freed buffer
            self.copies.popleft()[3].synchronize()
        self.wait()

    def wait(self) -> None:
        """Wait for every gradient write (a failure is kept in ``error``)."""
        while self.writes:
            try:
                self.writes.popleft()[0].wait()
            except (OffloadIOError, OSError) as exc:
                self.error = self.error or exc

    # --- for the optimizer ---------------------------------------------------------------------------
    def all_finite(self) -> bool:
        return all(self.finite.values())

    def sum_sq(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for v in self.sq.values():
            total += v
        return total

    def zero(self) -> None:
        """After the step (or a skipped one): the next gradient starts from zero."""
        for _, _, _, done in self.copies:
            done.synchronize()
        self.copies.clear()
        self.open.clear()
        self.wait()
        self.held.clear()
        self.sq.clear()
        self.finite.clear()
        self.scale = 1.0

    def host_bytes(self) -> int:
        return sum(b.numel() * 4 for b, _ in self.open.values()) + sum(b.numel() * 4 for _, b in self.writes)


class HostGrads:
    """CPU offload on an accelerator: this rank's fp32 gradient partitions live on the host, where the optimizer
    runs. Each completed bucket's reduced slice is copied off the device on a side stream into a (pinned)
    staging tensor; at most ``MAX_COPIES`` copies are outstanding, and each is added into the host partition
    when it has landed (all of them by the end of the micro-step). Nothing of the gradient partition stays
    on the device. The optimizer reads the host partitions as its gradients (``partition``)."""

    resident = True
    MAX_COPIES = 4

    def __init__(self, numels: list[int], pin: bool, accelerator: Any) -> None:
        pin = pin and can_pin_memory()  # pinning needs a CUDA host allocator (a no-op on CPU, as DeepSpeed)
        self.pin, self.acc = pin, accelerator
        self.parts = [torch.zeros(n, dtype=torch.float32, pin_memory=pin) for n in numels]
        self.stream = accelerator.side_stream()
        self.copies: deque[tuple[int, int, torch.Tensor, Any]] = deque()

    def partition(self, gi: int) -> torch.Tensor:
        return self.parts[gi]

    @torch.no_grad()
    def add(self, gi: int, lo: int, values: torch.Tensor) -> None:
        host, done = self.acc.copy_to_host(values.reshape(-1), self.pin, self.stream)
        self.copies.append((gi, lo, host, done))
        while len(self.copies) > self.MAX_COPIES:
            self._land()

    def _land(self) -> None:
        gi, lo, host, done = self.copies.popleft()
        done.synchronize()
        self.parts[gi][lo:lo + host.numel()].add_(host)

    def end_micro_step(self) -> None:
        while self.copies:
            self._land()

    def zero(self) -> None:
        self.end_micro_step()
        for p in self.parts:
            p.zero_()

    def host_bytes(self) -> int:
        return sum(p.numel() * 4 for p in self.parts)
