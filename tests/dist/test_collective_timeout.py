"""Hang: a rank that stops participating makes the others fail within ``comms_timeout_s``, naming rank, op, group."""

from __future__ import annotations

import time
from typing import Any

from zerospeed.testing import run_distributed

from .ckpt_common import build, train


def _one_rank_hangs(timeout_s: float) -> Any:
    from zerospeed import comm

    engine = build(2, {"comms_timeout_s": timeout_s})
    if comm.get_rank() == 1:
        time.sleep(timeout_s + 1.5)  # stops participating
        return None
    t0 = time.monotonic()
    try:
        train(engine, 1)
    except comm.CollectiveError as exc:
        return time.monotonic() - t0, str(exc)
    return "no error"


def test_hung_rank_is_reported_within_the_timeout() -> None:
    (elapsed, message), _ = run_distributed(_one_rank_hangs, 2, 1.5, timeout=60)
    assert 1.0 <= elapsed < 1.5 + 1.5
    assert message.startswith("rank 0: collective '") and "on group ranks [0, 1]" in message
    assert "comms_timeout_s" in message
