"""Unused parameters and their late gradients (the reducer's ``late``; see ``grad_reducer.py``).

After the first backward the ranks agree, per process group (one flag all-reduce each), which parameters got
no gradient anywhere; those no longer hold their bucket back (``ArrivalTracker.learn_unused``). A gradient
such a parameter sends after its bucket was launched goes to a late buffer of the bucket's layout. Before
the optimizer step one 4-byte all-reduce per axis tells every rank whether any rank holds late gradients;
if so the affected buckets are reduced once more and added in (the same result as if they had waited), and
their parameters are waited for again from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import comm
from .arrival import ArrivalTracker
from .reducer_parts import GroupAxes, ReduceSettings, scales
from .sharded_group import ShardedGroup


class LateGrads:
    def __init__(self, groups: list[ShardedGroup], settings: ReduceSettings, axes: GroupAxes,
                 tracker: ArrivalTracker, store: Any, dest: Any) -> None:
        self.groups, self.s, self.axes, self.tracker, self.store, self.dest = groups, settings, axes, tracker, store, dest
        self.buffers: dict[int, torch.Tensor] = {}  # bucket position -> gradients that arrived after its launch

    def buffer(self, k: int) -> torch.Tensor:
        buf = self.buffers.get(k)
        if buf is None:
            g, b = self.tracker.order[k]
            grp = self.groups[g]
            buf = self.buffers[k] = torch.zeros(grp.num_partitions * grp.plan.buckets[b].shard_numel,
                                                dtype=self.s.accum_dtype, device=grp.device)
        return buf

    def learn_unused(self) -> None:
        """After the first backward: parameters that got no gradient on any rank count as arrived from now on."""
        unused: set[tuple[int, int]] = set()
        for gs, group, size in self.axes:
            keys = self.tracker.keys(gs)
            got = torch.tensor([float(k in self.tracker.got) for k in keys],
                               device=comm.device_for_backend(group) if size > 1 else None)
            if size > 1:
                comm.all_reduce_flags(got, group=group)
            unused |= {k for k, used in zip(keys, got.tolist()) if not used}
        self.tracker.learn_unused(unused)

    @torch.no_grad()
    def settle(self) -> None:
        """Add in the late gradients of every rank (collective: every rank decides alike)."""
        if not self.tracker.unused:
            return
        for gs, group, size in self.axes:
            ks = [k for k, (g, _) in enumerate(self.tracker.order) if g in gs]
            if size == 1 or not comm.all_reduce_max_flag(any(k in self.buffers for k in ks), group=group):
                continue
            mask = torch.tensor([float(k in self.buffers) for k in ks], device=comm.device_for_backend(group))
            comm.all_reduce_flags(mask, group=group)
            for k, flag in zip(ks, mask.tolist()):
                if flag:
                    self._add(k, self.buffers.pop(k, None), group, size)
                    self.tracker.readmit(k)

    def _add(self, k: int, late: torch.Tensor | None, group: Any, size: int) -> None:
        """Reduce bucket k's late gradients (zeros where this rank has none) and add them to the result."""
        g, b = self.tracker.order[k]
        grp = self.groups[g]
        n, width = grp.num_partitions, grp.plan.buckets[b].shard_numel
        dtype = self.store.comm_dtype(g, b)
        send = torch.zeros(n * width, dtype=dtype, device=grp.device) if late is None else late.to(dtype)
        pre, post = scales(self.s, size)
        send.mul_(pre)
        if n > 1 and self.s.reduce_scatter:
            mine = torch.empty(width, dtype=send.dtype, device=send.device)
            comm.reduce_scatter(mine, send, group=group, scratch=True)
        else:
            comm.all_reduce(send, group=group)
            mine = send.view(n, width)[grp.rank] if n > 1 else send
        mine = mine.to(self.s.accum_dtype) * post
        if n == 1 and self.dest.in_place:
            self.store.bucket(g, b).add_(mine)
        else:
            self.dest.add(g, b, mine)

    def check_all_used(self, name: Callable[[int, int], str]) -> None:
        """``ignore_unused_parameters: false`` (DeepSpeed's stages 1-2): every trainable parameter had a gradient."""
        missing = [name(g, i) for g, i in self.tracker.missing()]
        if missing:
            raise RuntimeError(
                f"{len(missing)} trainable parameter(s) got no gradient in this step: {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}. Make every trainable parameter and forward output take part "
                "in the loss, or set zero_optimization.ignore_unused_parameters to true (DeepSpeed's default).")

    def clear(self) -> None:
        self.buffers.clear()
