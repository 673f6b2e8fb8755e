"""The benchmark harness measures the same computation for every contender: equal losses on the tiny GPT."""

from __future__ import annotations

import pytest

from benchmarks.contenders import BenchSpec, ddp, fsdp2, single, zerospeed_stage
from benchmarks.harness import run_all


def test_every_contender_trains_the_same_model() -> None:
    spec = BenchSpec(preset="tiny", micro_batch=4, grad_accum=2, world_size=2, warmup=0, steps=2)
    contenders = [single(), ddp(), fsdp2(reshard_after_forward=False, name="fsdp2 keep"), fsdp2(),
                  *(zerospeed_stage(s) for s in range(4))]
    results = run_all(spec, contenders, log=False)
    assert [r.contender for r in results] == [c.name for c in contenders]  # nothing skipped
    reference = results[0].last_loss
    for r in results:
        assert r.last_loss == pytest.approx(reference, rel=1e-5), r.contender
        assert r.wall_s_per_step > 0 and r.state_mib > 0
    by_name = {r.contender: r for r in results}
    psi_bytes = by_name["one process"].state_detail["params"]  # MiB of fp32 parameters
    # ZeRO stages shrink per-rank state; stage 0 and 1 all-reduce / reduce-scatter + all-gather 2 Psi.
    assert by_name["zerospeed stage 2"].state_mib < by_name["zerospeed stage 0"].state_mib
    assert by_name["zerospeed stage 0"].comm_bytes_per_step == pytest.approx(2 * psi_bytes * 2**20, rel=1e-3)
    assert by_name["torch DDP"].comm_bytes_per_step is None
