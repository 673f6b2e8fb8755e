"""All-gather through CUDA symmetric memory: DeepCompile's ``compile.symmetric_memory``.

The idea (DeepSpeed's DeepCompile does the same in C++, ``csrc/compile/z3.cpp``): every rank of a group maps
one workspace that each peer can read directly (CUDA peer-to-peer over NVLink or PCIe). An all-gather is then
copy-engine work with no NCCL kernel: each rank copies its shard into its own slot of the workspace, the ranks
meet at a barrier of the symmetric memory itself, each rank pulls every peer's slot into its output (starting
with its own, then rank-1, rank-2, ... so that the ranks do not all read the same peer at once), and a second
barrier keeps a fast rank from overwriting its slot while a slow peer still reads it. All on the current
stream, so the result is ordered with the compute that uses it.

Built on ``torch.distributed._symmetric_memory`` (``empty``, ``rendezvous``, the handle's ``get_buffer`` and
``barrier``): a private PyTorch surface, named in docs/compile.md and pinned by the GPU tests. It needs CUDA
tensors on an NCCL group: ``missing`` says why a group cannot have it (Gloo on the CPU has no symmetric memory),
and the engine refuses ``compile.symmetric_memory`` with that reason. The ranks must also share a node (peer
access); that is not checked here, and torch's rendezvous fails for a group that spans nodes.

The workspace holds the largest gather asked so far; a larger one grows it (collectively: every rank gathers
the same sizes in the same order, which stage 3's lockstep checks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .backend import Group, backend_name, get_rank, get_world_size
from .recoverable import resolve

BARRIER_TIMEOUT_MS = 600_000  # a peer that never reaches the barrier fails the gather after 10 minutes


def missing(group: Group | None, device: torch.device) -> str | None:
    """Why ``group`` on ``device`` cannot gather through symmetric memory, or None when it can."""
    if device.type != "cuda":
        return f"symmetric memory is CUDA peer-to-peer memory; this engine's device is {device.type!r}"
    name = backend_name(group)
    if name != "nccl":
        return f"the data-parallel group's backend is {name!r}; symmetric memory needs NCCL process groups on CUDA"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:  # pragma: no cover - every torch >= 2.5 has it
        return f"this PyTorch has no torch.distributed._symmetric_memory ({exc})"
    return None


class SymmetricGather:
    """One group's symmetric workspace and its all-gather."""

    def __init__(self, group: Group | None, device: torch.device, nbytes: int = 1 << 20) -> None:
        if device.type != "cuda":  # the engine checks the group too (``missing``); a test may rendezvous over Gloo
            raise RuntimeError(f"symmetric memory is CUDA peer-to-peer memory, not {device.type!r} memory")
        self.pg = _pg(group)
        self.device = device
        self.rank, self.world = get_rank(group), get_world_size(group)
        self.capacity = 0
        self.handle: Any = None
        self.buf: torch.Tensor | None = None
        self.gathers = 0
        self._grow(nbytes)

    def _grow(self, nbytes: int) -> None:
        from torch.distributed import _symmetric_memory as symm

        symm.enable_symm_mem_for_group(self.pg.group_name)  # idempotent: registers the group's store
        self.buf = symm.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.handle = symm.rendezvous(self.buf, self.pg.group_name)
        self.capacity = nbytes

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (flat, ``world`` times ``input``'s elements) receives every rank's ``input`` in rank order."""
        n = input.numel()
        if output.numel() != n * self.world or not output.is_contiguous():
            raise ValueError(f"symmetric all-gather: output of {output.numel()} elements for {self.world} ranks of "
                             f"{n} (contiguous needed)")
        nbytes = n * input.element_size()
        if nbytes > self.capacity:
            self._grow(max(nbytes, 2 * self.capacity))
        h = self.handle
        h.get_buffer(self.rank, (n,), input.dtype, 0).copy_(input.reshape(-1))
        h.barrier(0, BARRIER_TIMEOUT_MS)
        chunks = output.view(self.world, n)
        for step in range(self.world):
            peer = (self.rank - step) % self.world
            chunks[peer].copy_(h.get_buffer(peer, (n,), input.dtype, 0))
        h.barrier(0, BARRIER_TIMEOUT_MS)
        self.gathers += 1


_GATHERS: dict[int, SymmetricGather] = {}  # id of the process group -> its symmetric gather


def _pg(group: Group | None) -> Any:
    pg = resolve(group)
    return dist.group.WORLD if pg is None else pg


def enable(group: Group | None, device: torch.device) -> SymmetricGather:
    """From now on ``comm.all_gather`` on ``group``'s CUDA tensors goes through symmetric memory."""
    pg = _pg(group)
    gather = _GATHERS.get(id(pg))
    if gather is None:
        gather = _GATHERS[id(pg)] = SymmetricGather(group, device)
    return gather


def disable(group: Group | None) -> None:
    _GATHERS.pop(id(_pg(group)), None)


def gather_for(group: Group | None, tensor: torch.Tensor) -> SymmetricGather | None:
    """The symmetric gather serving ``tensor`` on ``group``, or None (not enabled, or not a CUDA tensor)."""
    if not _GATHERS or tensor.device.type != "cuda":
        return None
    return _GATHERS.get(id(_pg(group)))
