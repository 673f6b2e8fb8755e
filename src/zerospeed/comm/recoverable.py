"""A process group that can be dropped after a failure and rebuilt with fresh connections.

Why: when one rank raises inside a training step, its peers are blocked in (or about to enter) a
collective that rank will never join, and the group's per-collective sequence numbers no longer agree
across ranks. With Gloo, the failing rank *dropping* its group (destroying the backend closes its TCP
pairs) makes every peer's pending or next collective on that group fail at once ("connection closed by
peer"), instead of after the timeout. The next use of a dropped group on each rank rebuilds it (a
store-based rendezvous, as ``new_group``) and training continues on new connections. Other groups —
the world group the user's own code talks on — are untouched.

Every ``comm`` function accepts a ``RecoverableGroup`` wherever it takes a group (:func:`resolve`), so
components keep the same object across rebuilds. Creating and rebuilding are collective over the whole
world (``new_group`` numbering): every rank must do them in the same order.
"""

from __future__ import annotations

import gc
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class RecoverableGroup:
    """All ranks of the world on connections of their own, replaceable after a failure."""

    def __init__(self, timeout: timedelta | float | None = None) -> None:
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=float(timeout))
        self.timeout = timeout or _world_timeout()
        self.ranks = list(range(dist.get_world_size()))
        self.rank = dist.get_rank()
        self.generation = 0
        self._pg: Any = dist.new_group(self.ranks, timeout=self.timeout)
        # Every handle launched on this group that may still be in flight: ``drop`` lets go of their work
        # objects itself, so a handle some component (or an exception's traceback) still references does not
        # keep the connections open until the peers time out.
        self._in_flight: weakref.WeakSet[Any] = weakref.WeakSet()

    @property
    def pg(self) -> Any:
        """The live torch group; a dropped one is rebuilt first (every rank must get here)."""
        if self._pg is None:
            self.rebuild()
        return self._pg

    @property
    def dropped(self) -> bool:
        return self._pg is None

    def size(self) -> int:
        return len(self.ranks)

    def drop(self) -> None:
        """Destroy this rank's backend (closing its connections: peers' collectives fail at once).

        Collectives this rank still has queued run first (peers that are behind complete them). A backend
        work object still referenced keeps the connections open (until the peers time out), so every handle
        launched on this group and not yet completed is released here first: whoever still holds one gets an
        error from its ``wait()``, not a hang.
        """
        for handle in list(self._in_flight):
            handle.release()
        self._in_flight.clear()
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            dist.destroy_process_group(pg)
        except Exception:  # noqa: BLE001 - already broken: dropping the reference is what matters
            pass
        del pg
        gc.collect(0)  # a young cycle may hold it; a full collection costs ~1 s with torch loaded

    def track(self, handle: Any) -> Any:
        """Remember an in-flight ``handle`` (anything with ``release()``) launched on this group; returns it."""
        self._in_flight.add(handle)
        return handle

    def rebuild(self) -> None:
        """New connections among the same ranks (every rank must call this; waits up to the timeout)."""
        self.drop()
        self._pg = dist.new_group(self.ranks, timeout=self.timeout)
        self.generation += 1

    def __repr__(self) -> str:
        return f"RecoverableGroup(ranks={self.ranks}, generation={self.generation}, dropped={self.dropped})"


def resolve(group: Any) -> Any:
    """The torch process group behind ``group`` (``None`` stays ``None``: the world)."""
    if isinstance(group, RecoverableGroup):
        return group.pg
    return group


def _world_timeout() -> timedelta:
    """The world group's collective timeout (the engine's group inherits it unless told otherwise)."""
    for device in ("cpu", "cuda"):
        try:
            return dist.group.WORLD._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - no backend for this device, or it does not expose its options
            continue
    return timedelta(minutes=30)
