"""ZenFlow's step (``zero_optimization.zenflow``): important columns on the device now, the rest on the host later.

Per rank, on its flat fp32 master partition ``M`` and reduced (unscaled, clipped) gradient ``G_t``:

- warm-up (``t < full_warm_up_rounds``): the ordinary offloaded step of every element;
- at a selection (``schedule.py``): all-reduce the column sums of ``G_t``, pick the top columns
  (``select.py``) -> element set ``S``; the device-side Adam state of ``S`` restarts at zero (its step count
  does not, as in DeepSpeed);
- every step: ``A += G_t`` (all elements); the device-side Adam steps ``M[S]`` with ``G_t[S]``;
- at a host update: the host Adam steps every element with ``A / n`` (``n`` steps accumulated; step count
  ``t + 1``, DeepSpeed's ``step_id``), the selected elements keep their device-side values, ``A`` restarts.
  With ``overlap_step`` the host update runs in a worker thread on its own copy ``C`` of the master while the
  next steps train; its result reaches ``M`` (all but ``S``) at the next host update: one interval stale
  (a reselection first waits for it and applies it; a checkpoint save waits for it and saves it unapplied).

The write-back after each step all-gathers ``M`` into the model, so the model sees ``S`` move every step.
Checkpoints: ``sync_for_checkpoint`` finishes a pending host update and writes ZenFlow's own state into
``optimizer.state`` as element-wise ``zenflow_*`` entries and plain values (``state.py``), so it reshards.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from ... import comm
from ...config import ConfigError
from ...config.zenflow import ZenFlowConfig
from ..stepper import OffloadStepper
from ..cores import available_cores, bind_this_thread, split_cores
from ..partial import HostWorker
from ..subgroups import SubGroup
from .schedule import AutoInterval, Schedule
from .select import Layout, column_sums, layout_of, matrix_sums, selected_elements, top_columns
from .state import ZenFlowCheckpoint


class ZenFlowStepper(OffloadStepper):
    """The offloaded step of ``OffloadStepper`` (cpu), split by ZenFlow."""

    def __init__(self, *args: Any, zenflow: ZenFlowConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.kernel is None or self.host is None:
            raise ConfigError("zero_optimization.zenflow", f"ZenFlow steps Adam, AdamW or Adagrad; "
                              f"{type(self.optimizer).__name__} is not supported yet by zerospeed with zenflow")
        for g in self.groups:
            assert g.master is not None and not g.alias, "zenflow needs a flat master (separate_master=True)"
        self.zf = zenflow
        update = 0 if zenflow.update_interval == "auto" else int(zenflow.update_interval)
        self.schedule = Schedule(zenflow.full_warm_up_rounds, zenflow.resolved_select_interval(), update)
        self.auto = AutoInterval(zenflow.topk_ratio, zenflow.auto_ratio) if update == 0 else None
        self.layouts: list[Layout] = [layout_of(g) for g in self.groups]
        self.t = 0  # iterations (optimizer steps) taken
        self.n = 0  # gradients accumulated in ``accum`` since the last host update
        self.accum = [torch.zeros(g.plan.partition_numel) for g in self.groups]
        self.columns: list[list[torch.Tensor]] = [[] for _ in self.groups]
        self.selected = [torch.zeros(0, dtype=torch.long) for _ in self.groups]
        self.sel_state: list[dict[str, torch.Tensor]] = [{} for _ in self.groups]
        self.sel_step = torch.zeros((), dtype=torch.float32)
        self.home = torch.device("cpu") if zenflow.offload else self.groups[0].device
        self.host_updates = 0  # how many host updates were applied (for tests and logs)
        # overlap_step: the host update's own master copy, a second accumulator, and the update in flight
        self.cpu_master = [g.master.clone() for g in self.groups] if zenflow.overlap_step else []  # type: ignore[union-attr]
        self.spare = [torch.zeros_like(a) for a in self.accum] if zenflow.overlap_step else []
        self.pending: Future[None] | None = None
        self.core_split: tuple[list[int], list[int]] | None = None  # (training, host update) cores, once split
        self.ckpt = ZenFlowCheckpoint(self)

    def set_steps_per_epoch(self, steps: int) -> None:
        """Resolve an ``epoch`` select strategy from the training data loader's length (in optimizer steps)."""
        if self.zf.steps_per_epoch is None and self.zf.select_strategy != "step" and steps > 0:
            self.schedule.select_interval = self.zf.resolved_select_interval(steps)

    # --- the step ------------------------------------------------------------------------------------
    def _step_host(self, grads: list[torch.Tensor]) -> None:
        assert self.host is not None
        if self.pending is not None and self.host.replaced():
            self._drop_pending()  # a checkpoint was loaded: the update in flight belongs to the old state
        self.host.adopt()
        self.ckpt.adopt()
        t = self.t
        if self.schedule.in_warm_up(t):
            self._host_step(grads, [g.master for g in self.groups], t)  # type: ignore[misc]
            self.t += 1
            return
        sums = None
        if self.schedule.selects(t):
            self._finish_pending()
            sums = self._column_sums(grads)
            self._select(sums)
        for a, g in zip(self.accum, grads):
            a.add_(g)
        self.n += 1
        self._device_step(grads)
        if self.auto is not None:
            sums = self._column_sums(grads) if sums is None else sums
            due = self._auto_due(sums) or self.schedule.before_reselect(t)
        else:
            due = self.schedule.fixed_update(t)
        if due:
            self._host_update(t)
            if self.auto is not None:
                self.auto.restart()
        self.t += 1

    def _column_sums(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every group's column sums, added over the ranks (one all-reduce)."""
        parts = [column_sums(g, lay) for g, lay in zip(grads, self.layouts)]
        flat = torch.cat(parts) if parts else torch.zeros(0)
        if self.partitioned and flat.numel():
            flat = flat.to(comm.device_for_backend(self.dp_group))
            comm.all_reduce(flat, group=self.dp_group)
            flat = flat.cpu()
        return list(torch.split(flat, [p.numel() for p in parts]))

    def _select(self, sums: list[torch.Tensor]) -> None:
        for gi, lay in enumerate(self.layouts):
            self.columns[gi] = top_columns(sums[gi], lay, self.zf.topk_ratio)
            self.selected[gi] = selected_elements(lay, self.columns[gi])
            n = self.selected[gi].numel()
            group = self.optimizer.param_groups[gi]
            self.sel_state[gi] = {k: torch.full((n,), self.kernel.initial(k, group), device=self.home)  # type: ignore[union-attr]
                                  for k in self.kernel.state_keys}  # type: ignore[union-attr]
        if self.cpu_master:  # the host copy starts from the trained values (DeepSpeed syncs its fp32 master)
            for c, g in zip(self.cpu_master, self.groups):
                c.copy_(g.master)  # type: ignore[arg-type]

    def _auto_due(self, sums: list[torch.Tensor]) -> bool:
        assert self.auto is not None
        pairs = [matrix_sums(s, lay, cols) for s, lay, cols in zip(sums, self.layouts, self.columns)]
        total = torch.cat([p[0] for p in pairs]) if pairs else torch.zeros(0)
        critical = torch.cat([p[1] for p in pairs]) if pairs else torch.zeros(0)
        return self.auto.observe(total, critical)

    @torch.no_grad()
    def _device_step(self, grads: list[torch.Tensor]) -> None:
        """Adam on the selected elements, on the device (their state on the host between steps if ``offload``)."""
        self.sel_step += 1
        for gi, grp in enumerate(self.groups):
            idx = self.selected[gi]
            if idx.numel() == 0:
                continue
            dev = grp.device
            master = grp.master
            assert master is not None
            values = master[idx].to(dev)
            states = {k: [v.to(dev)] for k, v in self.sel_state[gi].items()}
            self.kernel.step([values], [grads[gi][idx].to(dev)], states, self.sel_step.to(dev),  # type: ignore[union-attr]
                             self.optimizer.param_groups[gi])
            master[idx] = values.to(master.device)
            if dev != self.home:
                for k, v in states.items():
                    self.sel_state[gi][k].copy_(v[0])

    def _host_step(self, grads: list[torch.Tensor], masters: list[torch.Tensor], t: int) -> None:
        """The host Adam over every element of every sub-group, step count ``t + 1``."""
        assert self.host is not None and self.kernel is not None
        for s in self.steps:
            s.fill_(float(t + 1))
        for sgs in self.subgroups:
            for sg in sgs:
                self._host_subgroup(sg, grads, masters)

    def _host_subgroup(self, sg: SubGroup, grads: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        assert self.host is not None and self.kernel is not None
        pieces = [(x, y) for x, y in sg.pieces]
        self.kernel.step([masters[sg.gi][x:y] for x, y in pieces], [grads[sg.gi][x:y] for x, y in pieces],
                         self.host.piece_states(sg), self.steps[sg.gi], self.optimizer.param_groups[sg.gi])

    @torch.no_grad()
    def _host_update(self, t: int) -> None:
        for a in self.accum:
            a.div_(self.n)
        self.n = 0
        if not self.zf.overlap_step:
            masters = [g.master for g in self.groups]
            keep = [m[idx].clone() for m, idx in zip(masters, self.selected)]  # type: ignore[index]
            self._host_step(self.accum, masters, t)  # type: ignore[arg-type]
            for m, idx, k in zip(masters, self.selected, keep):
                m[idx] = k  # type: ignore[index]
            for a in self.accum:
                a.zero_()
            self.host_updates += 1
            return
        self._finish_pending()  # the previous interval's update reaches the model now
        job, self.accum, self.spare = self.accum, self.spare, self.accum
        if self.worker is None:
            self.worker = HostWorker()
            self._split_cores()
        self.pending = self.worker.submit(lambda: self._host_step(job, self.cpu_master, t))

    def _split_cores(self) -> None:
        """``pt_reserved_cores_perc``: the training thread keeps its share of the cores, the overlapped host
        update's thread runs on the rest (offload/cores.py)."""
        assert self.worker is not None
        train, update = split_cores(available_cores(), self.zf.pt_reserved_cores_perc)
        bind_this_thread(train)
        self.worker.submit(lambda: bind_this_thread(update) and None).result()
        self.core_split = (train, update)

    @torch.no_grad()
    def _finish_pending(self) -> None:
        """Wait for the host update in flight and give its values to every unselected element."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.result()
        for grp, c, idx in zip(self.groups, self.cpu_master, self.selected):
            m = grp.master
            assert m is not None
            keep = m[idx].clone()
            m.copy_(c)
            m[idx] = keep
        for a in self.spare:
            a.zero_()
        self.host_updates += 1

    @torch.no_grad()
    def _drop_pending(self) -> None:
        assert self.pending is not None
        pending, self.pending = self.pending, None
        pending.exception()  # wait; its result (and any error) is discarded
        for a in self.spare:
            a.zero_()
        for c, g in zip(self.cpu_master, self.groups):
            c.copy_(g.master)  # type: ignore[arg-type]

    # --- checkpoints, accounting, lifecycle ----------------------------------------------------------
    def sync_for_checkpoint(self) -> None:
        """Let the host update in flight finish (it is saved as done but not yet applied, so a save does not
        change the run) and write ZenFlow's state into ``optimizer.state``."""
        super().sync_for_checkpoint()
        if self.pending is not None:
            self.pending.result()
        self.ckpt.write()

    def state_bytes_by_home(self) -> dict[str, int]:
        sel = sum(v.numel() * 4 for st in self.sel_state for v in st.values())
        host = self.host_state_bytes() + sum(a.numel() * 4 for a in [*self.accum, *self.spare, *self.cpu_master])
        return {"device": 0 if self.zf.offload else sel, "host": host + (sel if self.zf.offload else 0)}

    def close(self, restore: bool = True) -> None:
        try:
            self._finish_pending()
        finally:
            super().close(restore)

