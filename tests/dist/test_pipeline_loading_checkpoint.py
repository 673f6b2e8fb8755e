"""``zero_optimization.pipeline_loading_checkpoint`` at world 2 (one node): the ranks read the checkpoint one
after another (local rank 0 first), each holding its read tensors only in its turn, and the resumed run equals
the uninterrupted one."""

from __future__ import annotations

import time
from typing import Any

import torch

from zerospeed.testing import run_distributed

from .ckpt_common import build, full_state, train

ZERO3 = {"stage": 3, "reduce_bucket_size": 200, "allgather_bucket_size": 300, "stage3_param_persistence_threshold": 0}


def _resume(path: str) -> dict[str, Any]:
    from zerospeed.runtime.checkpoint import load as load_mod

    engine = build(3)
    ref = train(engine, 2)
    engine.save_checkpoint(path)
    ref += train(engine, 2)
    want = full_state(engine, fp32=True)

    reads: list[tuple[float, float, int, int]] = []  # (start, end, ranges held before, after)
    inner = load_mod.relay_turn

    def timed(ctx: Any, *args: Any) -> str:
        start, held = time.monotonic(), len(ctx.reader._ranges)
        out = inner(ctx, *args)
        time.sleep(0.05)  # a turn long enough that overlapping turns would show
        reads.append((start, time.monotonic(), held, len(ctx.reader._ranges)))
        return out

    load_mod.relay_turn = timed
    try:
        resumed = build(3, {"zero_optimization": {**ZERO3, "pipeline_loading_checkpoint": True}})
        loaded, _ = resumed.load_checkpoint(path)
    finally:
        load_mod.relay_turn = inner
    assert loaded is not None and resumed.global_steps == 2
    tail = train(resumed, 2)
    return {"ref": ref, "tail": tail, "reads": reads, "want": want, "got": full_state(resumed, fp32=True)}


def test_ranks_of_a_node_load_in_turns_and_resume_equals_the_straight_run(tmp_path: Any) -> None:
    out = run_distributed(_resume, 2, str(tmp_path), timeout=120)
    for r in out:
        assert r["ref"][:2] + r["tail"] == r["ref"], f"resumed losses differ: {r['tail']} vs {r['ref'][2:]}"
        for k, v in r["want"].items():
            torch.testing.assert_close(r["got"][k], v, rtol=0, atol=0, msg=k)
        assert len(r["reads"]) == 1
        assert r["reads"][0][2:] == (0, 0), "a rank held read tensors outside its turn"
    (_, e0, *_), (s1, *_) = out[0]["reads"][0], out[1]["reads"][0]
    assert s1 >= e0, f"local rank 1 read at {s1:.3f}, before local rank 0 finished at {e0:.3f}"
