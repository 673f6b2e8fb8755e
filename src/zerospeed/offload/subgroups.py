"""Sub-groups: the units in which an offloaded optimizer steps and swaps its state.

A group's state is laid out like its gradient partition (the partition plan's flat coordinates, length
``plan.partition_numel``). A sub-group is the flat range ``[lo, hi)`` of at most ``sub_group_size``
elements; its *pieces* are the parts of that range that hold fp32 master values (the whole range when the
group keeps a flat master; each parameter's elements when the master is the model itself), each with a
host view of the master.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..zero import ShardedGroup
from ..accelerator import can_pin_memory


@dataclass
class SubGroup:
    gi: int
    index: int
    lo: int
    hi: int
    pieces: list[tuple[int, int]] = field(default_factory=list)
    masters: list[torch.Tensor] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def name(self) -> str:
        return f"g{self.gi}_s{self.index}"


def master_ranges(grp: ShardedGroup) -> list[tuple[int, int, torch.Tensor | None]]:
    """``(lo, hi, flat master view)`` of every stretch of the flat layout that holds master values (no view
    for a master without storage: a deferred or parked one lives in the swap files)."""
    if not grp.alias:
        assert grp.master is not None
        resident = grp.master.untyped_storage().nbytes() > 0
        return [(0, grp.plan.partition_numel, grp.master if resident else None)]
    out = []
    for i, p in enumerate(grp.params):
        start, _ = grp.slot_range(i)
        out.append((start, start + p.numel(), p.data.view(-1)))
    return out


def plan_subgroups(grp: ShardedGroup, gi: int, size: int) -> list[SubGroup]:
    """Cut group ``gi``'s flat layout into sub-groups of at most ``size`` elements (empty ones dropped)."""
    ranges = master_ranges(grp)
    total = grp.plan.partition_numel
    out: list[SubGroup] = []
    for lo in range(0, total, size):
        sg = SubGroup(gi, len(out), lo, min(lo + size, total))
        for a, b, t in ranges:
            x, y = max(a, sg.lo), min(b, sg.hi)
            if x < y:
                sg.pieces.append((x, y))
                if t is not None:
                    sg.masters.append(t[x - a:y - a])
        if sg.pieces:
            out.append(sg)
    for k, sg in enumerate(out):
        sg.index = k
    return out


def move_master_to_host(grp: ShardedGroup, pin: bool = False) -> None:
    """Keep the fp32 master partition (and the optimizer's per-parameter views of it) in host memory.

    Call before the optimizer is built over ``grp.master_params``. A group whose master *is* the model
    (one partition, fp32) cannot move; the stepper refuses it off the CPU.
    """
    if grp.master is None or grp.master.device.type == "cpu":
        return
    host = torch.empty(grp.master.shape, dtype=grp.master.dtype, pin_memory=pin and can_pin_memory())
    host.copy_(grp.master)
    grp.master = host
    grp.master_params = [torch.nn.Parameter(grp.slot_view(host, i)) for i in range(len(grp.params))]
