"""What ``engine.destroy()`` gives back besides hooks and monitors: the connections the engine opened.

Each engine talks on a process group of its own (``comm.RecoverableGroup``, docs/recovery.md); with Gloo a
group holds native threads and buffers (3 threads and ~24 MiB of address space per engine here), so an
engine built and destroyed in a loop (a sweep, a notebook, tests) must close it. Groups the engine did not
create (a pipeline's or a user's mpu grid, the world group) are left alone.
"""

from __future__ import annotations

from typing import Any

from .. import comm


def close_own_groups(engine: Any) -> None:
    """Drop the engine's own recoverable groups (not collective: each rank closes its side)."""
    seen: set[int] = set()
    for name in ("dp_group", "checkpoint_group"):
        group = getattr(engine, name, None)
        if isinstance(group, comm.RecoverableGroup) and id(group) not in seen:
            seen.add(id(group))
            group.drop()
