"""An async save's out-of-band failure channel: the world's rendezvous store, not the checkpoint's disk.

The writer threads of an async save issue no collectives (they would race the training step's collectives on
the same group). A rank whose write fails used to say so only by a file in the staging directory; when that
rank cannot write to the directory at all, the record was lost and rank 0 waited ``comms_timeout_s``. The
failure (and rank 0's outcome) now also goes to the process group's key-value store, which every rank
reaches over the network, so the other ranks see it within a poll interval.
"""

from __future__ import annotations

import json
from typing import Any

from ... import comm


class FailureChannel:
    """Keys ``zerospeed/ckpt/<staging name>/{failed,outcome}`` in the world store (no-ops without a store)."""

    def __init__(self, staging_name: str, store: Any = None) -> None:
        self.store = store if store is not None else comm.default_store()
        self.prefix = f"zerospeed/ckpt/{staging_name}"

    def _set(self, key: str, value: Any) -> None:
        if self.store is None:
            return
        try:
            self.store.set(f"{self.prefix}/{key}", json.dumps(value))
        except Exception:  # noqa: BLE001 - best effort, like the file record
            pass

    def _get(self, key: str) -> Any:
        if self.store is None:
            return None
        full = f"{self.prefix}/{key}"
        try:
            if not self.store.check([full]):
                return None
            return json.loads(self.store.get(full))
        except Exception:  # noqa: BLE001 - a store that is gone says nothing
            return None

    def publish_failure(self, rank: int, error: str) -> None:
        self._set("failed", f"rank {rank}: {error}")

    def failure(self) -> str | None:
        return self._get("failed")

    def publish_outcome(self, error: str | None) -> None:
        self._set("outcome", {"ok": error is None, "error": error})

    def outcome(self) -> dict[str, Any] | None:
        return self._get("outcome")


