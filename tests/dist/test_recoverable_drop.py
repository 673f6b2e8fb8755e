"""Dropping a ``RecoverableGroup`` closes its connections at once even while some component (or an exception's
traceback) still holds a handle launched on it: the peer's collective fails in milliseconds, not at the timeout.

A Gloo work object keeps its connections open for as long as it lives. Before ``drop`` released the handles it
had launched itself, one reference left behind on the failing rank (a gather op a shard still pointed at, a
cycle the garbage collector had not reached) made the peer wait out ``comms_timeout_s``; this is what the
engine's failed-step recovery relies on (tests/dist/test_step_failure.py).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

TIMEOUT_S = 6.0


def _held_while_dropped(kind: str) -> dict[str, Any]:
    from zerospeed import comm

    group = comm.RecoverableGroup(TIMEOUT_S)
    comm.all_reduce(torch.ones(4), group=group)  # connected
    if kind == "collective" and comm.get_rank() == 0:
        comm.all_reduce(torch.ones(7), group=group)  # the peer's collective, which it launched and never waited for
    if comm.get_rank() == 1:
        # A launch whose handle stays referenced, not waited for (as a leaked reference would be): a collective
        # the peer joined, or a receive it never sends to.
        if kind == "collective":
            held = comm.all_reduce(torch.ones(7), group=group, async_op=True)
        else:
            held = comm.exchange([comm.P2P("recv", torch.empty(7), 0, tag=99)], group=group)
        group.drop()
        try:
            held.wait()
        except comm.CollectiveError as exc:
            return {"held": str(exc)}
        return {"held": "no error"}
    t0 = time.monotonic()
    try:  # what the peer was doing when rank 1 failed: a collective of another kind
        if kind == "collective":
            comm.exchange([comm.P2P("recv", torch.empty(3), 1, tag=98)], group=group).wait()
        else:
            comm.all_reduce(torch.ones(5), group=group)
    except comm.CollectiveError as exc:
        group.drop()
        return {"elapsed": time.monotonic() - t0, "message": str(exc)}
    return {"elapsed": time.monotonic() - t0, "message": "no error"}


@pytest.mark.parametrize("kind", ["collective", "p2p"])
def test_drop_closes_connections_a_held_handle_would_keep_open(kind: str) -> None:
    peer, failing = run_distributed(_held_while_dropped, 2, kind, timeout=60)
    assert peer["elapsed"] < TIMEOUT_S / 2, peer
    assert "closed by peer" in peer["message"].lower() or "reset" in peer["message"].lower(), peer
    assert failing["held"].startswith("rank 1: ") and "was abandoned: its group was dropped" in failing["held"]
