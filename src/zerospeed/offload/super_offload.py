"""SuperOffload (``offload_optimizer.super_offload``, DeepSpeed's ``SuperOffloadOptimizer_Stage3``): the host
optimizer step of each sub-group starts *during* backward, as soon as that sub-group's gradient is complete,
and is validated at ``step()``.

Speculation. On the accumulation-boundary micro-step the reducer hands every reduced gradient slice to the
sink (``SpeculativeGrads``), which counts the elements each sub-group has received; the moment a sub-group
is complete it goes to a worker thread that runs the fused CPU kernel on it, while backward carries on with
the earlier layers (the fused kernel releases the GIL). The gradient is unscaled by the loss scale of this
backward on the way. As in DeepSpeed this happens only with ``gradient_clipping: 0``: a clipped step needs
the global norm first, so with clipping every sub-group is stepped at ``step()`` (the plain offloaded step).

Validation. ``step()`` waits for the speculative steps (they must be done before the optimizer reads or
scales the gradients), then:

* overflow (fp16, or bf16 with ``check_grad_overflow``): every speculated sub-group is rolled back. DeepSpeed
  inverts the Adam update algebraically; zerospeed restores a copy of the sub-group's master and state taken
  before its speculative step, so a skipped step leaves exactly the state a non-offloaded skip leaves. The
  copies are taken only when an overflow can be detected (4 bytes x (1 + state tensors) per element of the
  speculated sub-groups, on the host, from the sub-group's completion to ``step()``);
* otherwise the speculative updates stand, and the sub-groups that were not speculated (clipping on, or a
  parameter that got no gradient this step) are stepped now.

Placement (DeepSpeed's rule): sub-groups of ``zero_optimization.sub_group_size`` elements, in order; with
``ratio: 1`` (the default) all of them live and step on the host. DeepSpeed runs SuperOffload only on CUDA
(its Superchip target); zerospeed runs the same schedule on the CPU too (tested there for parity).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from .partial import HostWorker
from .stepper import OffloadStepper
from .subgroups import SubGroup

Key = tuple[int, int]  # (group, sub-group index)


class SpeculativeGrads:
    """The reducer's sink under SuperOffload: this rank's fp32 gradient partitions in host memory, and on the
    boundary micro-step a call of ``on_complete(sub_group)`` as soon as a sub-group has all its elements."""

    resident = True

    def __init__(self, subgroups: list[list[SubGroup]], numels: list[int],
                 on_complete: Callable[[SubGroup], None] | None, before_read: Callable[[], None]) -> None:
        self.parts = [torch.zeros(n, dtype=torch.float32) for n in numels]
        self.subgroups, self.on_complete, self.before_read = subgroups, on_complete, before_read
        self.need = {(sg.gi, sg.index): sum(y - x for x, y in sg.pieces) for sgs in subgroups for sg in sgs}
        self.got: dict[Key, int] = {}
        self.launched: set[Key] = set()
        self.stale: set[Key] = set()  # launched, then another slice arrived: the speculation is void
        self._reducer: Any = None

    def follow(self, reducer: Any) -> None:
        """The reducer whose ``boundary`` (this micro-step ends the accumulation) gates the speculation."""
        self._reducer = reducer

    def partition(self, gi: int) -> torch.Tensor:
        self.before_read()  # the optimizer reads (and may scale) the gradients: speculative steps finish first
        return self.parts[gi]

    @torch.no_grad()
    def add(self, gi: int, lo: int, values: torch.Tensor) -> None:
        flat = values.reshape(-1)
        hi = lo + flat.numel()
        self.parts[gi][lo:hi].add_(flat.to(self.parts[gi].device, torch.float32))
        speculating = self.on_complete is not None and self._reducer is not None and self._reducer.boundary
        for sg in self.subgroups[gi]:
            if sg.hi <= lo or sg.lo >= hi:
                continue
            key = (gi, sg.index)
            if key in self.launched:
                self.stale.add(key)
                continue
            self.got[key] = self.got.get(key, 0) + sum(max(0, min(y, hi) - max(x, lo)) for x, y in sg.pieces)
            if speculating and self.got[key] >= self.need[key]:
                self.launched.add(key)
                assert self.on_complete is not None
                self.on_complete(sg)

    def end_micro_step(self) -> None:
        self.got.clear()

    def zero(self) -> None:
        self.before_read()
        for p in self.parts:
            p.zero_()
        self.got.clear()
        self.launched.clear()
        self.stale.clear()

    def host_bytes(self) -> int:
        return sum(p.numel() * 4 for p in self.parts)


class SuperOffloadStepper(OffloadStepper):
    """The CPU-offloaded step with speculation during backward and validation at ``step()`` (module docstring).

    ``speculate``: start sub-group steps during backward (DeepSpeed: only without gradient clipping);
    ``undoable``: an overflow can skip the step, so keep what a rollback restores; ``inv_scale()``: the
    factor that unscales this backward's gradients (1 / loss scale)."""

    def __init__(self, *args: Any, speculate: bool, undoable: bool, inv_scale: Callable[[], float],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.host is None or self.kernel is None:
            raise ValueError("SuperOffload steps Adam, AdamW or Adagrad with the fused CPU kernel; "
                             f"{type(self.optimizer).__name__} is not supported yet by zerospeed with super_offload")
        self.undoable, self.inv_scale = undoable, inv_scale
        self.worker = HostWorker()
        self.pending: list[Future[None]] = []
        self.saved: dict[Key, tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]] = {}
        self.begun = False
        self.speculated_last = 0  # sub-groups whose step ran during backward, in the last step
        self.sink = SpeculativeGrads(self.subgroups, [g.plan.partition_numel for g in self.groups],
                                     self._speculate if speculate else None, self._join)

    # --- speculation ---------------------------------------------------------------------------------
    def _start(self) -> None:
        if not self.begun:
            assert self.host is not None
            self.host.adopt()
            self._begin()
            self.begun = True

    def _speculate(self, sg: SubGroup) -> None:
        self._start()
        factor = float(self.inv_scale())
        self.pending.append(self.worker.submit(lambda: self._speculative_step(sg, factor)))

    @torch.no_grad()
    def _speculative_step(self, sg: SubGroup, factor: float) -> None:
        assert self.host is not None and self.kernel is not None
        states = self.host.piece_states(sg)
        if self.undoable:
            self.saved[(sg.gi, sg.index)] = ([m.clone() for m in sg.masters],
                                              {k: [t.clone() for t in v] for k, v in states.items()})
        part = self.sink.parts[sg.gi]
        grads = [part[x:y] if factor == 1.0 else part[x:y] * factor for x, y in sg.pieces]
        self.kernel.step(sg.masters, grads, states, self.steps[sg.gi], self.optimizer.param_groups[sg.gi])

    def _join(self) -> None:
        """Wait for every speculative step; the first error is raised (inside the step's agreement)."""
        pending, self.pending = self.pending, []
        errors = []
        for f in pending:
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after every job has finished
                errors.append(exc)
        if errors:
            raise errors[0]

    @torch.no_grad()
    def _restore(self, key: Key, sg: SubGroup) -> None:
        assert self.host is not None
        if key not in self.saved:
            raise RuntimeError(f"SuperOffload: sub-group {sg.name} was stepped during backward, then more of its "
                               "gradient arrived (a parameter unused in an earlier step got a gradient again), and "
                               "without an overflow check no copy was kept to roll it back: SuperOffload with "
                               "parameters that are used only in some steps is not supported yet by zerospeed")
        masters, states = self.saved.pop(key)
        for dst, src in zip(sg.masters, masters):
            dst.copy_(src)
        for k, pieces in self.host.piece_states(sg).items():
            for dst, src in zip(pieces, states[k]):
                dst.copy_(src)

    # --- validation ----------------------------------------------------------------------------------
    def _step_host(self, grads: list[torch.Tensor]) -> None:
        self._join()
        self._start()
        jobs = [sg for sgs in self.subgroups for sg in sgs]
        for sg in jobs:
            if (sg.gi, sg.index) in self.sink.stale:
                self._restore((sg.gi, sg.index), sg)  # void speculation: stepped again below
        redo = [sg for sg in jobs if (sg.gi, sg.index) not in self.sink.launched
                or (sg.gi, sg.index) in self.sink.stale]
        self.speculated_last = len(jobs) - len(redo)
        self._host_jobs(grads, redo)
        self._settle()

    def on_skipped_step(self) -> None:
        """The step was skipped (overflow): undo the speculative updates and the step count."""
        self._join()
        for sgs in self.subgroups:
            for sg in sgs:
                if (sg.gi, sg.index) in self.sink.launched:
                    self._restore((sg.gi, sg.index), sg)
        if self.begun:
            for s in self.steps:
                s -= 1
        self.speculated_last = 0
        self._settle()

    def _settle(self) -> None:
        self.begun = False
        self.saved.clear()

    def close(self, restore: bool = True) -> None:
        try:
            self._join()
        finally:
            super().close(restore)
