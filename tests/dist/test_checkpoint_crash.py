"""Crash safety: SIGKILL the trainer at random moments while it saves; the newest complete checkpoint loads.

The trainer is forked from this (warm) process, saves after every step, and reports each save that
returned. After each kill: ``latest`` must name a checkpoint that verifies (every file against the
manifest), at least as new as the last save reported, and it must load into a fresh engine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from typing import Any

from zerospeed.runtime.checkpoint import verify_checkpoint
from zerospeed.runtime.checkpoint.layout import LATEST
from zerospeed.testing import run_distributed

from .ckpt_common import build, train

SAVES = 10


def _trainer(path: str, store: str, conn: Any) -> None:
    from zerospeed import comm

    comm.init_distributed(dist_backend="gloo", store=comm.file_store(store, 1), rank=0, world_size=1)
    engine = build(2)
    conn.send(0)
    for k in range(1, SAVES + 1):
        train(engine, 1)
        engine.save_checkpoint(path, tag=f"step{k}")
        conn.send(k)
    conn.send(-1)


def _load(path: str) -> int:
    engine = build(1, {"checkpoint": {"load_universal": True}})  # saved at world 1, loaded at world 2
    engine.load_checkpoint(path)
    return engine.global_steps


def test_sigkill_during_saves_leaves_latest_loadable(tmp_path: Any) -> None:
    ctx = mp.get_context("fork")
    rng = random.Random(0)
    path = str(tmp_path / "ckpt")
    checked = 0
    for trial in range(10):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_trainer, args=(path, str(tmp_path / f"store{trial}"), send), daemon=True)
        proc.start()
        send.close()
        assert recv.poll(30), "trainer did not start"
        recv.recv()
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        reported = 0
        while recv.poll():
            try:
                reported = max(reported, recv.recv())
            except EOFError:
                break
        if not os.path.exists(os.path.join(path, LATEST)):
            assert reported == 0
            continue
        ckpt = verify_checkpoint(path)
        assert int(os.path.basename(ckpt).removeprefix("step")) >= reported
        checked += 1
    assert checked >= 5
    assert run_distributed(_load, 2, path, timeout=60)[0] >= 1
