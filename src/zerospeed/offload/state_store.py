"""Where offloaded optimizer state lives: host tensors (``cpu``) or sub-group swap files (``nvme``).

Both stores keep the torch optimizer's ``state`` addressable per master parameter with torch's keys
(``step``, ``exp_avg``, ``exp_avg_sq`` / ``sum``), so checkpoints save and load offloaded state like any
other. ``HostStore`` installs views of flat per-group buffers in ``optimizer.state`` and re-adopts whatever
a checkpoint load put there. ``SwappedState`` *is* ``optimizer.state`` under nvme: reading a parameter's
entry reads its elements from the swap files, assigning one writes them. A group's files may hold one more
region after the optimizer's keys, its fp32 master (``master_home.py``); ``layout_keys`` names them all.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
from torch import nn

from ..zero import ShardedGroup
from .cpu_adam import FlatKernel
from .subgroups import SubGroup
from .swapper import AsyncSwapper, round_up


def state_layout(sg: SubGroup, keys: tuple[str, ...]) -> tuple[int, dict[str, int]]:
    """Bytes of a sub-group's state buffer and the byte offset of each key's region (4 KiB-aligned)."""
    region = round_up(sg.numel * 4)
    return region * len(keys), {k: j * region for j, k in enumerate(keys)}


def state_views(buf: torch.Tensor, sg: SubGroup, keys: tuple[str, ...]) -> dict[str, list[torch.Tensor]]:
    """Per key, the fp32 views of ``buf`` matching the sub-group's master pieces."""
    _, offsets = state_layout(sg, keys)
    out: dict[str, list[torch.Tensor]] = {}
    for k in keys:
        flat = buf[offsets[k]:offsets[k] + sg.numel * 4].view(torch.float32)
        out[k] = [flat[x - sg.lo:y - sg.lo] for x, y in sg.pieces]
    return out


class HostStore:
    """CPU offload: one flat host buffer per group and key (fp32; bf16 under ``bf16_optimizer_states``);
    ``optimizer.state`` holds views of it."""

    def __init__(self, groups: list[ShardedGroup], optimizer: torch.optim.Optimizer, kernel: FlatKernel,
                 steps: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
        self.groups, self.optimizer, self.kernel, self.steps = groups, optimizer, kernel, steps
        self.flat = [{k: torch.full((g.plan.partition_numel,), kernel.initial(k, optimizer.param_groups[gi]),
                                    dtype=dtype)
                      for k in kernel.state_keys} for gi, g in enumerate(groups)]
        self.views: list[list[dict[str, torch.Tensor]]] = [
            [{k: g.slot_view(self.flat[gi][k], i) for k in kernel.state_keys} for i in range(len(g.params))]
            for gi, g in enumerate(groups)]
        self.adopt()

    def piece_states(self, sg: SubGroup) -> dict[str, list[torch.Tensor]]:
        return {k: [self.flat[sg.gi][k][x:y] for x, y in sg.pieces] for k in self.kernel.state_keys}

    @torch.no_grad()
    def adopt(self) -> bool:
        """Point ``optimizer.state`` at our buffers, first copying in any tensors placed there (a load);
        returns whether anything was copied in."""
        state = self.optimizer.state
        loaded = False
        for gi, g in enumerate(self.groups):
            for i, mp in enumerate(g.master_params):
                st = state.get(mp)
                mine = self.views[gi][i]
                if st is not None and st.get("step") is not None and st["step"] is not self.steps[gi]:
                    self.steps[gi].fill_(float(st["step"]))
                if st is None or any(st.get(k) is not v for k, v in mine.items()):
                    loaded = loaded or st is not None
                    for k, v in mine.items():
                        src = None if st is None else st.get(k)
                        if torch.is_tensor(src):
                            v.copy_(src.reshape(v.shape))
                        elif st is not None:  # a missing key starts fresh, as in torch
                            v.fill_(self.kernel.initial(k, self.optimizer.param_groups[gi]))
                state[mp] = {**(st or {}), "step": self.steps[gi], **mine}
        return loaded

    def replaced(self) -> bool:
        """Whether something (a checkpoint load) put other tensors in ``optimizer.state`` since ``adopt``."""
        state = self.optimizer.state
        return any(state.get(mp) is None or any(state[mp].get(k) is not v for k, v in self.views[gi][i].items())
                   for gi, g in enumerate(self.groups) for i, mp in enumerate(g.master_params))

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.flat for t in d.values())


class SwappedState(MutableMapping[nn.Parameter, dict[str, Any]]):
    """``optimizer.state`` under nvme offload: per-parameter entries read from / written to swap files."""

    def __init__(self, groups: list[ShardedGroup], subgroups: list[list[SubGroup]], kernel: FlatKernel,
                 swapper: AsyncSwapper, steps: list[torch.Tensor], param_groups: list[dict[str, Any]],
                 layout_keys: list[tuple[str, ...]] | None = None) -> None:
        self.groups, self.subgroups, self.kernel, self.swapper = groups, subgroups, kernel, swapper
        self.steps, self.param_groups = steps, param_groups
        self.layout_keys = layout_keys or [kernel.state_keys for _ in groups]
        self.where = {mp: (gi, i) for gi, g in enumerate(groups) for i, mp in enumerate(g.master_params)}

    # --- files ---------------------------------------------------------------------------------------
    def layout(self, sg: SubGroup) -> tuple[int, dict[str, int]]:
        return state_layout(sg, self.layout_keys[sg.gi])

    def fresh(self, sg: SubGroup, buf: torch.Tensor) -> None:
        """Fill a sub-group buffer with the initial state (before its first step; a master region gets 0)."""
        buf[: self.layout(sg)[0]].view(torch.float32).fill_(0.0)
        for k, views in state_views(buf, sg, self.kernel.state_keys).items():
            value = self.kernel.initial(k, self.param_groups[sg.gi])
            for v in views:
                v.fill_(value)

    def ensure(self, sg: SubGroup, master: torch.Tensor | None = None) -> None:
        """Create the sub-group's file holding the initial state (and ``master``, the values of its master
        region, when given), if it was never written."""
        if sg.name in self.swapper.sizes:
            return
        nbytes, offsets = self.layout(sg)
        group = self.param_groups[sg.gi]
        if master is None and all(self.kernel.initial(k, group) == 0.0 for k in self.kernel.state_keys):
            self.swapper.allocate(sg.name, nbytes)  # all zeros: reserved, not written
            return
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.fresh(sg, buf)
        if master is not None:
            buf[offsets["master"]:offsets["master"] + sg.numel * 4].view(torch.float32).copy_(master)
        self.swapper.write(sg.name, buf).wait()

    def _spans(self, gi: int, i: int) -> Iterator[tuple[SubGroup, int, int, int]]:
        """(sub-group, byte offset in its key region, start and end within the parameter's flat state)."""
        g = self.groups[gi]
        start, _ = g.slot_range(i)
        n = self.groups[gi].master_params[i].numel()
        for sg in self.subgroups[gi]:
            x, y = max(start, sg.lo), min(start + n, sg.hi)
            if x < y:
                yield sg, (x - sg.lo) * 4, x - start, y - start

    # --- mapping -------------------------------------------------------------------------------------
    def __getitem__(self, mp: nn.Parameter) -> dict[str, Any]:
        if mp not in self.where:
            raise KeyError(mp)
        gi, i = self.where[mp]
        st: dict[str, Any] = {"step": self.steps[gi]}
        for k in self.kernel.state_keys:
            out = torch.empty(mp.numel(), dtype=torch.float32)
            out.fill_(self.kernel.initial(k, self.param_groups[gi]))
            for sg, off, a, b in self._spans(gi, i):
                if sg.name in self.swapper.sizes:
                    _, offsets = self.layout(sg)
                    self.swapper.read_range(sg.name, offsets[k] + off, out[a:b])
            st[k] = out.view(mp.shape)
        return st

    @torch.no_grad()
    def __setitem__(self, mp: nn.Parameter, st: dict[str, Any]) -> None:
        gi, i = self.where[mp]
        if st.get("step") is not None:
            self.steps[gi].fill_(float(st["step"]))
        for k in self.kernel.state_keys:
            src = st.get(k)
            flat = (src.detach().to("cpu", torch.float32).reshape(-1) if torch.is_tensor(src) else
                    torch.full((mp.numel(),), self.kernel.initial(k, self.param_groups[gi])))
            for sg, off, a, b in self._spans(gi, i):
                self.ensure(sg)
                _, offsets = self.layout(sg)
                self.swapper.write_range(sg.name, offsets[k] + off, flat[a:b])

    def __delitem__(self, mp: nn.Parameter) -> None:
        self[mp] = {}

    def __iter__(self) -> Iterator[nn.Parameter]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)
