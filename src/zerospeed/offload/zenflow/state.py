"""ZenFlow's own state in checkpoints: written into ``optimizer.state`` next to Adam's, read back after a load.

Per master parameter, element-wise (so it reshards like ``exp_avg``): ``zenflow_selected`` (1 where the
element is selected), ``zenflow_<key>`` for the device-side optimizer state of the selected elements (0
elsewhere) and ``zenflow_accum`` (the gradients accumulated for the host). Plain values, the same on every
rank: the iteration, the accumulated count, the device-side step count, the ``auto`` rule's counters,
whether an overlapped host update is done but not applied (``zenflow_cpu_master``, element-wise, holds its
result) and, for a 2-D weight, its selected columns (``"3,7,12"``) and ``auto`` sums. The entries exist only from a save
to the next step, which removes them (or adopts them, after a load).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .stepper import ZenFlowStepper

PREFIX = "zenflow_"


class ZenFlowCheckpoint:
    def __init__(self, owner: ZenFlowStepper) -> None:
        self.z = owner
        self.written: dict[int, Any] = {}  # id(master param) -> the mask tensor we put there

    def _params(self) -> list[tuple[int, int, Any]]:
        return [(gi, i, mp) for gi, g in enumerate(self.z.groups) for i, mp in enumerate(g.master_params)]

    def _matrix_slots(self) -> dict[tuple[int, int], int]:
        """(group, parameter) -> position in the ``auto`` rule's per-weight vectors."""
        out, j = {}, 0
        for gi, lay in enumerate(self.z.layouts):
            for m in lay.matrices:
                out[(gi, m.index)] = j
                j += 1
        return out

    @torch.no_grad()
    def write(self) -> None:
        z, state = self.z, self.z.optimizer.state
        keys = z.kernel.state_keys  # type: ignore[union-attr]
        flats = []
        for gi, g in enumerate(z.groups):
            n, idx = g.plan.partition_numel, z.selected[gi]
            mask = torch.zeros(n)
            mask[idx] = 1.0
            st = {k: torch.zeros(n) for k in keys}
            for k in keys:
                if k in z.sel_state[gi]:
                    st[k][idx] = z.sel_state[gi][k].cpu()
            flats.append((mask, st))
        auto = z.auto
        common: dict[str, Any] = {"pending": z.pending is not None, "iteration": z.t, "accumulated": z.n, "selective_step": float(z.sel_step),
                                  "auto_steps": auto.steps if auto is not None else 0}
        slots = self._matrix_slots()
        cols = {(gi, m.index): c for gi, lay in enumerate(z.layouts) for m, c in zip(lay.matrices, z.columns[gi])}
        self.written.clear()
        for gi, i, mp in self._params():
            g, (mask, st) = z.groups[gi], flats[gi]
            entry: dict[str, Any] = {PREFIX + "selected": g.slot_view(mask, i), PREFIX + "accum": g.slot_view(z.accum[gi], i)}
            entry.update({PREFIX + k: g.slot_view(v, i) for k, v in st.items()})
            if z.cpu_master:  # overlap_step: the host update's own master (its last update maybe not applied yet)
                entry[PREFIX + "cpu_master"] = g.slot_view(z.cpu_master[gi], i)
            entry.update({PREFIX + k: v for k, v in common.items()})
            if (gi, i) in cols:
                entry[PREFIX + "columns"] = ",".join(str(int(c)) for c in cols[(gi, i)])
            if auto is not None and (gi, i) in slots and auto.avg_critical.numel():
                entry[PREFIX + "avg_critical"] = float(auto.avg_critical[slots[(gi, i)]])
                entry[PREFIX + "non_critical"] = float(auto.non_critical[slots[(gi, i)]])
            state[mp].update(entry)
            self.written[id(mp)] = entry[PREFIX + "selected"]

    @torch.no_grad()
    def adopt(self) -> None:
        """After a save: drop the entries. After a load: take ZenFlow's state from them, then drop them."""
        z, state = self.z, self.z.optimizer.state
        params = self._params()
        found = [(gi, i, mp, state.get(mp)) for gi, i, mp in params]
        found = [f for f in found if f[3] is not None and PREFIX + "selected" in f[3]]
        if not found:
            return
        if any(st[PREFIX + "selected"] is not self.written.get(id(mp)) for _, _, mp, st in found):
            self._load(found)
        for _, _, mp, st in found:
            state[mp] = {k: v for k, v in st.items() if not k.startswith(PREFIX)}
        self.written.clear()

    def _load(self, found: list[tuple[int, int, Any, dict[str, Any]]]) -> None:
        z = self.z
        keys = z.kernel.state_keys  # type: ignore[union-attr]
        masks = [torch.zeros(g.plan.partition_numel) for g in z.groups]
        sts = [{k: torch.zeros(g.plan.partition_numel) for k in keys} for g in z.groups]
        for gi, i, _, st in found:
            g = z.groups[gi]
            g.slot_view(masks[gi], i).copy_(st[PREFIX + "selected"].reshape(g.slot_view(masks[gi], i).shape))
            g.slot_view(z.accum[gi], i).copy_(st[PREFIX + "accum"].reshape(g.slot_view(masks[gi], i).shape))
            for k in keys:
                g.slot_view(sts[gi][k], i).copy_(st[PREFIX + k].reshape(g.slot_view(masks[gi], i).shape))
        first = found[0][3]
        z.t, z.n = int(first[PREFIX + "iteration"]), int(first[PREFIX + "accumulated"])
        z.sel_step.fill_(float(first[PREFIX + "selective_step"]))
        by_param = {(gi, i): st for gi, i, _, st in found}
        for gi, lay in enumerate(z.layouts):
            z.selected[gi] = torch.nonzero(masks[gi]).flatten()
            z.sel_state[gi] = {k: sts[gi][k][z.selected[gi]].to(z.home) for k in keys}
            z.columns[gi] = [torch.tensor([int(c) for c in str(by_param.get((gi, m.index), {}).get(PREFIX + "columns", "")).split(",")
                                           if c != ""], dtype=torch.long) for m in lay.matrices]
        if z.auto is not None:
            slots = self._matrix_slots()
            avg, rest = torch.zeros(len(slots)), torch.zeros(len(slots))
            for (gi, i), j in slots.items():
                avg[j] = float(by_param.get((gi, i), {}).get(PREFIX + "avg_critical", 0.0))
                rest[j] = float(by_param.get((gi, i), {}).get(PREFIX + "non_critical", 0.0))
            z.auto.avg_critical, z.auto.non_critical = avg, rest
            z.auto.steps = int(first[PREFIX + "auto_steps"])
        saved_cpu = all(PREFIX + "cpu_master" in st for _, _, _, st in found)
        for gi, (c, g) in enumerate(zip(z.cpu_master, z.groups)):
            c.copy_(g.master)  # type: ignore[arg-type]
            if saved_cpu:
                for fgi, i, _, st in found:
                    if fgi == gi:
                        view = g.slot_view(c, i)
                        view.copy_(st[PREFIX + "cpu_master"].reshape(view.shape))
        if z.cpu_master and saved_cpu and bool(first.get(PREFIX + "pending", False)):
            done: Future[None] = Future()  # the saved host update is done; it reaches the model at the next one
            done.set_result(None)
            z.pending = done
