"""Point-to-point transfers (pipeline activations and gradients) and device meshes.

``exchange`` posts a list of sends and receives as one ``batch_isend_irecv`` batch and returns a handle;
peers are global ranks and ``group`` is the group they talk in (a pipeline group). Every transfer is
counted by the comms logger (op ``send`` / ``recv``), and a failure names this rank, the op and the peer,
so a dead or hung neighbour stage is reported precisely instead of as a bare transport error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .backend import Group, get_rank
from .collectives import CollectiveError
from .logger import loggers
from .recoverable import RecoverableGroup, resolve


@dataclass(frozen=True)
class P2P:
    """One transfer: ``kind`` is ``"send"`` or ``"recv"``, ``peer`` a global rank."""

    kind: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0


def _describe(ops: list[P2P]) -> str:
    return ", ".join(f"{o.kind} {'to' if o.kind == 'send' else 'from'} rank {o.peer}" for o in ops)


_DEAD_KEY = "zerospeed/p2p_first_dead_rank"


def _first_dead(peer: int) -> int | None:
    """Record ``peer`` as dead in the job's store unless another rank recorded one first; return the first.

    A stage two hops from a dead rank only sees its own neighbour exit; the store tells it which rank died
    first. Best effort: None when the store cannot be reached quickly.
    """
    from datetime import timedelta

    try:
        store = dist.distributed_c10d._get_default_store()  # no public accessor in torch 2.13
        store.set_timeout(timedelta(seconds=5))
        first = store.compare_set(_DEAD_KEY, "", str(peer))
        return int(first.decode() if isinstance(first, bytes) else first)
    except Exception:  # noqa: BLE001 - only improves an error message
        return None


def _fail(ops: list[P2P], exc: BaseException) -> CollectiveError:
    text = str(exc)
    hint = ""
    peers = sorted({o.peer for o in ops})
    if "timeout" in text.lower() or "timed out" in text.lower():
        hint = " -- the peer stage did not answer within the timeout (config 'comms_timeout_s'): it is hung or dead"
    elif "closed" in text.lower() or "reset" in text.lower() or "broken pipe" in text.lower():
        hint = " -- the peer process exited"
        first = _first_dead(peers[0])
        if first is not None and first not in peers:
            hint += f" after rank {first} died (rank {first} is the first dead rank)"
        elif first is not None:
            hint += f" (rank {first} is the first dead rank)"
    return CollectiveError(f"rank {get_rank()}: p2p {_describe(ops)} failed (peer rank{'s' if len(peers) > 1 else ''} "
                           f"{', '.join(map(str, peers))}): {text}{hint}")


class P2PHandle:
    """The posted batch; ``wait()`` completes it (and raises ``CollectiveError`` naming the peers)."""

    def __init__(self, works: list[Any], ops: list[P2P], t0: float) -> None:
        self._works = works
        self._ops = ops
        self._t0 = t0
        self.done = not works
        self.released = False
        self._loggers = loggers()

    def release(self) -> None:
        """Let go of the backend's work without waiting (its group is being dropped after a failure)."""
        if not self.done:
            self._works, self.released = [], True

    def wait(self) -> None:
        if self.released:
            raise CollectiveError(f"rank {get_rank()}: p2p {_describe(self._ops)} was abandoned: its group was "
                                  "dropped after a failed step")
        if self.done:
            return
        try:
            for w in self._works:
                w.wait()
        except RuntimeError as exc:
            self._works = []  # the rest would keep the connections open from the traceback
            raise _fail(self._ops, exc) from exc
        self.done = True
        seconds = time.perf_counter() - self._t0
        for kind in {o.kind for o in self._ops}:
            for lg in self._loggers:
                lg.add_time(kind, seconds)


def exchange(ops: list[P2P], group: Group | None = None) -> P2PHandle:
    """Post ``ops`` (sends and receives, any order) as one batch; ``wait()`` on the handle to complete them."""
    if not ops:
        return P2PHandle([], [], 0.0)
    t0 = time.perf_counter()
    pg = resolve(group)
    p2p_ops = [dist.P2POp(dist.isend if o.kind == "send" else dist.irecv, o.tensor, o.peer, pg, o.tag) for o in ops]
    try:
        works = dist.batch_isend_irecv(p2p_ops)
    except RuntimeError as exc:
        raise _fail(ops, exc) from exc
    own = loggers()
    for o in ops:
        n = o.tensor.numel() * o.tensor.element_size()
        for lg in own:
            lg.record(o.kind, n, n)
    handle = P2PHandle(list(works), ops, t0)
    return group.track(handle) if isinstance(group, RecoverableGroup) else handle


def device_mesh(device_type: str, dims: list[int], names: list[str]) -> Any:
    """A ``DeviceMesh`` over the whole job, shaped ``dims`` with axis ``names`` (row-major global ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(dims), mesh_dim_names=tuple(names))


def global_rank_of(group: Group | None, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (None: the world)."""
    if group is None or not dist.is_initialized():
        return group_rank
    return dist.get_global_rank(resolve(group), group_rank)
