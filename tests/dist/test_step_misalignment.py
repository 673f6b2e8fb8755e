"""An exception in the user's code between ``engine(...)`` and ``engine.backward()`` on one rank, caught as
docs/recovery.md suggests, is detected at the next backward on every rank (``runtime/lockstep.py``): the
window is abandoned everywhere and the ranks train on in step, instead of reducing rank 0's batch k with
rank 1's batch k+1 for the rest of the run (issue 31, item 7)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import make_model, micro_batch, param_groups

STEPS, FAIL, MB = 5, 2, 2


class Injected(RuntimeError):
    pass


def _train(stage: int) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.zero import full_state_dict

    world, rank = comm.get_world_size(), comm.get_rank()
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": MB, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "comms_timeout_s": 6.0, "steps_per_print": 1000}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    failures = []
    for step in range(STEPS + (rank == 1)):  # rank 1 lost one batch more (its own and the detected one)
        try:
            x, y = micro_batch(step, 0, rank, world, MB, 1)
            loss = engine(x, y)
            if rank == 1 and step == FAIL:
                raise Injected("the user's code between forward and backward")
            engine.backward(loss)
            engine.step()
        except Exception as exc:  # noqa: BLE001 - the loop a user writes
            failures.append((step, type(exc).__name__))
    sd = full_state_dict(engine.module, engine.optimizer, fp32=True, rank0_only=False)
    return {"failures": failures, "global_steps": engine.global_steps,
            "state": {k: v.detach().clone() for k, v in sd.items()}}


@pytest.mark.parametrize("stage", [1, 3])
def test_forward_without_backward_on_one_rank_is_detected_everywhere(stage: int) -> None:
    r0, r1 = run_distributed(_train, 2, stage, timeout=90)
    assert r0["failures"] == [(FAIL, "MicroStepMisaligned")], r0["failures"]
    assert r1["failures"] == [(FAIL, "Injected"), (FAIL + 1, "MicroStepMisaligned")], r1["failures"]
    assert r0["global_steps"] == r1["global_steps"]
    for k, v in r0["state"].items():
        torch.testing.assert_close(r1["state"][k], v, rtol=0, atol=0, msg=k)
