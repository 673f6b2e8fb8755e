"""Tiered checkpointing under DeepSpeed's ``nebula`` and ``datastates_ckpt`` keys: memory first, then disk.

Both are served by zerospeed's own background save (``save._save_async``): the save returns once every
rank's state is snapshotted into host memory (tier 1); a writer thread writes the files and rank 0 commits
them atomically to the save directory (tier 2), exactly as ``async_save`` does (a failure on any rank
commits nothing and is raised by the next save or ``wait_for_checkpoint``). What each key adds:

- ``nebula.num_of_version_in_retention``: after each commit rank 0 keeps the newest N committed
  checkpoints of the directory and removes the older ones (never the one ``latest`` names, never a
  directory that is not a zerospeed checkpoint).
- ``datastates_ckpt.host_cache_size`` (GB): the host memory a snapshot may take. When the largest rank's
  accounted state (parameters, fp32 masters, optimizer state, buffers) is bigger, the save is written
  synchronously from the state itself on every rank (the ranks agree first).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from ... import comm
from . import layout

logger = logging.getLogger(__name__)


def background_writes(config: Any) -> bool:
    """Whether a save returns after its snapshot: ``async_save``, a decoupled writer, Nebula or DataStates."""
    return config.checkpoint.background_writes or config.nebula.enabled or config.datastates_ckpt is not None


def snapshot_fits(engine: Any, group: Any) -> bool:
    """Collective: every rank's snapshot fits ``datastates_ckpt.host_cache_size`` (True without a cap)."""
    ds = engine.config.datastates_ckpt
    if ds is None or ds.host_cache_size is None:
        return True
    mine = engine.memory_breakdown()
    need = mine["params"] + mine["master"] + mine["optimizer_state"] + mine["buffers"]
    largest = max(comm.all_gather_object(need, group=group))
    cap = int(ds.host_cache_size * 1e9)
    if largest > cap and comm.get_rank(group) == 0:
        logger.info("datastates_ckpt.host_cache_size: a rank's state is %d bytes, over the %d-byte host cache: "
                    "this checkpoint is written synchronously", largest, cap)
    return largest <= cap


def retain(config: Any, save_dir: str) -> list[str]:
    """Rank 0, after a commit: ``nebula.num_of_version_in_retention`` newest committed checkpoints stay."""
    if not config.nebula.enabled:
        return []
    keep = config.nebula.num_of_version_in_retention
    pointer = os.path.join(save_dir, layout.LATEST)
    protected = layout.read_pointer(pointer) if os.path.isfile(pointer) else None
    committed = [e for e in os.scandir(save_dir) if e.is_dir() and not e.name.startswith(".")
                 and os.path.isfile(os.path.join(e.path, layout.MANIFEST))]
    committed.sort(key=lambda e: os.stat(os.path.join(e.path, layout.MANIFEST)).st_mtime_ns, reverse=True)
    removed = [e.name for e in committed[keep:] if e.name != protected]
    for name in removed:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    return removed
