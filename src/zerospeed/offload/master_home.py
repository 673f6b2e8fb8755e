"""The fp32 master partition on disk (NVMe offload): one more region, ``master``, in each sub-group's swap file.

Under ``offload_optimizer.device: nvme`` a group that keeps its own fp32 master (not one whose master is
the model) stores ``[lo, hi)`` of that master in sub-group ``j``'s swap file next to the optimizer
moments. The stepper reads it with the moments, updates it in the swap buffer and writes it back with
them, so between steps no master is resident (``ShardedGroup.park_master`` releases its storage). Code
outside the step reaches it range by range through :class:`SwappedMaster` (the group's ``master_home``):
the write-back after the step, checkpoints, ``GatheredParameters``' master refresh, fp32 exports.
"""

from __future__ import annotations

import weakref

import torch

from .state_store import state_layout
from .subgroups import SubGroup
from .swapper import AsyncSwapper

MASTER = "master"


class SwappedMaster:
    """Ranges of one group's flat master partition, read from / written to its sub-groups' swap files."""

    def __init__(self, subgroups: list[SubGroup], keys: tuple[str, ...], swapper: AsyncSwapper) -> None:
        self.subgroups, self.keys = subgroups, keys
        # Weak: the group must not keep the swap files alive once the engine (and its stepper) is gone.
        self._swapper = weakref.ref(swapper)

    @property
    def swapper(self) -> AsyncSwapper:
        sw = self._swapper()
        if sw is None:
            raise RuntimeError("the offloaded fp32 master is gone: its swap files were removed with the engine")
        return sw

    def _spans(self, lo: int, hi: int) -> list[tuple[SubGroup, int, int, int]]:
        """(sub-group, byte offset in its file, start and end within ``[lo, hi)``) for each overlap."""
        out = []
        for sg in self.subgroups:
            x, y = max(lo, sg.lo), min(hi, sg.hi)
            if x < y:
                out.append((sg, state_layout(sg, self.keys)[1][MASTER] + (x - sg.lo) * 4, x - lo, y - lo))
        return out

    def read(self, lo: int, hi: int) -> torch.Tensor:
        out = torch.zeros(max(hi - lo, 0), dtype=torch.float32)
        for sg, off, a, b in self._spans(lo, hi):
            self.swapper.read_range(sg.name, off, out[a:b])
        return out

    def write(self, lo: int, src: torch.Tensor) -> None:
        for sg, off, a, b in self._spans(lo, lo + src.numel()):
            self.swapper.write_range(sg.name, off, src[a:b])
