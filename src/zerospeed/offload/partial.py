"""Partial offload (``offload_optimizer.ratio``, DeepSpeed's Offload++): part of the step on the device.

DeepSpeed's rule, kept exactly: number the sub-groups of every optimizer group in order, ``0 .. n-1``
(``zero_optimization.sub_group_size`` elements each); sub-group ``i`` stays on the accelerator when
``i < int((1 - ratio) * n)`` and is offloaded to the CPU otherwise. So ``ratio`` is the fraction of
sub-groups (hence of optimizer state and step work) that goes to the host; ``ratio: 1`` is full offload,
``ratio: 0`` keeps every sub-group on the device.

Sub-groups ``[0, cut)``: master, Adam state and gradients on the device, stepped there.
Sub-groups ``[cut, n)``: the usual host step. Both halves run at once: the host half in a worker thread
(the fused CPU kernel releases the GIL), the device half on the calling thread.

Where the state lives. On an accelerator the device half keeps its state on the device; the host store keeps
a mirror of those ranges only for checkpoints (``flush`` before a save, ``reload`` after a load), and the
host master (the one the write-back all-gathers) receives the device half's updated values after each step
(4 bytes per element down; the device copy is refreshed from it before each step, 4 up). On a CPU-only
machine the "device" is the host: the device half steps straight on the host store's views, no copies.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from .cpu_adam import FlatKernel
from .state_store import HostStore
from .subgroups import SubGroup


def split_subgroups(jobs: list[SubGroup], ratio: float) -> tuple[list[SubGroup], list[SubGroup]]:
    """(device sub-groups, host sub-groups) by DeepSpeed's rule: the first ``int((1 - ratio) * n)`` stay."""
    cut = int((1.0 - ratio) * len(jobs))
    return jobs[:cut], jobs[cut:]


class DeviceShare:
    """The sub-groups stepped on the accelerator: their master, state and step."""

    def __init__(self, jobs: list[SubGroup], host: HostStore, kernel: FlatKernel, device: torch.device) -> None:
        self.jobs, self.host, self.kernel, self.device = jobs, host, kernel, device
        self.on_host = device.type == "cpu"
        # Per sub-group: master pieces and state pieces on the device (views of the host store on a CPU machine).
        self.masters: list[list[torch.Tensor]] = []
        self.states: list[dict[str, list[torch.Tensor]]] = []
        for sg in jobs:
            if self.on_host:
                self.masters.append(sg.masters)
                self.states.append(host.piece_states(sg))
            else:
                self.masters.append([torch.empty(y - x, device=device) for x, y in sg.pieces])
                self.states.append({k: [torch.empty(y - x, device=device) for x, y in sg.pieces]
                                    for k in kernel.state_keys})
        self.reload()

    @torch.no_grad()
    def reload(self) -> None:
        """Copy the host store's values of our ranges to the device (at build, after a checkpoint load)."""
        if self.on_host:
            return
        for sg, st in zip(self.jobs, self.states):
            for k, pieces in self.host.piece_states(sg).items():
                for dst, src in zip(st[k], pieces):
                    dst.copy_(src, non_blocking=True)

    @torch.no_grad()
    def flush(self) -> None:
        """Copy the device state of our ranges into the host store (before a checkpoint reads it)."""
        if self.on_host:
            return
        for sg, st in zip(self.jobs, self.states):
            for k, pieces in self.host.piece_states(sg).items():
                for dst, src in zip(pieces, st[k]):
                    dst.copy_(src)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], steps: list[torch.Tensor], param_groups: list[dict[str, Any]]) -> None:
        """One update of every device sub-group from the gradient partitions ``grads`` (any device)."""
        for sg, masters, st in zip(self.jobs, self.masters, self.states):
            g = [grads[sg.gi][x:y].to(self.device, non_blocking=True) for x, y in sg.pieces]
            if not self.on_host:
                for dst, src in zip(masters, sg.masters):
                    dst.copy_(src, non_blocking=True)
            step = steps[sg.gi] if self.on_host else steps[sg.gi].to(self.device)
            self.kernel.step(masters, g, st, step, param_groups[sg.gi])
            if not self.on_host:
                for dst, src in zip(sg.masters, masters):
                    dst.copy_(src)

    def state_bytes(self) -> int:
        return sum(sg.numel for sg in self.jobs) * 4 * len(self.kernel.state_keys)


class HostWorker:
    """One worker thread that runs the host half of a step while the caller runs the device half."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerospeed-offload")

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        return self.pool.submit(fn)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
