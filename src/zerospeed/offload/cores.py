"""How the host's cores are shared between training and the offloaded optimizer step (DeepSpeed's
``offload_optimizer.cpuadam_cores_perc`` and ``zenflow.pt_reserved_cores_perc``).

- ``cpuadam_cores_perc``: DeepSpeed gives its CPU Adam worker that share of the cores. zerospeed's host step
  runs in the training process, so the share is the number of torch threads the host step computes with:
  ``max(1, int(perc * n))`` of the ``n`` cores this process may run on, the caller's setting restored after.
- ``pt_reserved_cores_perc`` (ZenFlow with ``overlap_step``): ``ceil(perc * n)`` of the cores stay with the
  training thread, the rest go to the thread that runs the overlapped host update (its CPU affinity is set
  from inside it; Linux sets a thread's own affinity). Without ``overlap_step`` the update runs inline and
  there is nothing to split.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity where the OS has one, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def host_step_threads(perc: float, cores: int | None = None) -> int:
    """Threads for the host optimizer step: ``cpuadam_cores_perc`` of the cores, at least one."""
    n = len(available_cores()) if cores is None else cores
    return max(1, int(perc * n))


@contextlib.contextmanager
def host_step(perc: float) -> Iterator[None]:
    """Run the block with ``host_step_threads(perc)`` torch threads; the previous count comes back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(host_step_threads(perc))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def split_cores(cores: list[int], perc: float) -> tuple[list[int], list[int]]:
    """(training cores, optimizer cores): the first ``ceil(perc * n)`` stay with training (DeepSpeed's
    split); with one core, both share it."""
    keep = min(len(cores), max(1, math.ceil(perc * len(cores))))
    rest = cores[keep:] or cores[:keep]
    return cores[:keep], rest


def bind_this_thread(cores: list[int]) -> bool:
    """Pin the calling thread to ``cores`` (Linux); False where the OS has no per-thread affinity."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    os.sched_setaffinity(0, cores)
    return True
