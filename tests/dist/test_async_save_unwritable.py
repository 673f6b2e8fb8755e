"""Async save where one rank cannot write to the checkpoint directory at all (issue 31, item 9): the failure
reaches the other ranks over the world's key-value store within a poll interval, not after ``comms_timeout_s``
(the failure record on the same unwritable disk is lost)."""

from __future__ import annotations

import time
from typing import Any

from zerospeed.runtime.checkpoint import CheckpointError
from zerospeed.testing import run_distributed

from .ckpt_common import build, train


def _save(path: str) -> tuple[str, float]:
    from zerospeed import comm
    from zerospeed.runtime.checkpoint import layout, save

    engine = build(1, {"comms_timeout_s": 300})
    train(engine, 1)
    if comm.get_rank() == 1:  # this rank's disk refuses every write, the failure record included
        def unwritable(*_: Any, **__: Any) -> int:
            raise PermissionError(13, "Permission denied", path)

        save.write_snapshot = unwritable  # type: ignore[assignment]
        layout.publish_failure = lambda *a, **k: None  # type: ignore[assignment]
    t0 = time.monotonic()
    engine.save_checkpoint(path, tag="a", async_save=True)
    try:
        engine.wait_for_checkpoint()
        outcome = "committed"
    except (CheckpointError, RuntimeError) as exc:  # wait_for_checkpoint wraps the writer's error
        outcome = str(exc)
    return outcome, time.monotonic() - t0


def test_a_rank_that_cannot_write_fails_the_save_quickly(tmp_path: Any) -> None:
    results = run_distributed(_save, 2, str(tmp_path), timeout=60)
    for rank, (outcome, seconds) in enumerate(results):
        assert "rank 1" in outcome and "Permission denied" in outcome, (rank, outcome)
        assert seconds < 10, (rank, seconds)
    assert not (tmp_path / "latest").exists()
