"""0/1 Adam through the engine at world 2: the gradient all-reduce runs only on variance-update steps, the
other steps move 1-bit traffic only, ranks agree after each synchronisation, and it converges like Adam."""

from __future__ import annotations

import torch

from zerospeed.testing import run_distributed

from .test_onebit_adam import run_bytes

ZO = {"lr": 3e-3, "var_freeze_step": 12, "var_update_scaler": 2, "local_step_scaler": 4, "local_step_clipper": 2}


def test_allreduce_only_on_variance_steps_then_one_bit() -> None:
    results = run_distributed(run_bytes, 2, 0, 20, {"type": "ZeroOneAdam", "params": ZO}, timeout=120)
    steps = results[0]["per_step"]
    full = [bool(s.get("all_reduce", 0)) for s in steps]
    # calls 1-4 all-reduce (interval 1, then 2 from step 4), then 6, 8 (interval 4 from step 6: 12), none after
    assert full[:13] == [True, True, True, True, False, True, False, True, False, False, False, True, False]
    assert not any(full[13:])
    warm = steps[0]["all_reduce"]
    for s in steps[13:]:  # local steps: interval 1 then 2 (local_step_scaler 4, clipper 2)
        one_bit = s.get("all_to_all", 0) + s.get("all_gather", 0)
        assert one_bit <= warm / 25
    assert sum(1 for s in steps[13:] if s.get("all_to_all", 0)) < len(steps[13:]), "some steps are purely local"
    # the last step (20) is a synchronising one (20 % 2 == 0): every rank holds the same weights, up to the
    # rounding of undoing its own local steps (p + sum(local) - sum(local)), as in DeepSpeed
    for k, v in results[0]["state"].items():
        torch.testing.assert_close(results[1]["state"][k], v, rtol=0, atol=1e-6)


def test_converges_like_adam() -> None:
    params = {**ZO, "var_freeze_step": 30, "var_update_scaler": 4, "local_step_scaler": 8, "local_step_clipper": 4}
    zo = run_distributed(run_bytes, 2, 0, 80, {"type": "ZeroOneAdam", "params": params}, timeout=200)[0]["losses"]
    adam = run_distributed(run_bytes, 2, 0, 80, {"type": "Adam", "params": {"lr": 3e-3}}, timeout=200)[0]["losses"]
    tail_zo, tail_adam = sum(zo[-10:]) / 10, sum(adam[-10:]) / 10
    assert tail_zo < zo[0] / 5
    assert tail_zo <= 1.25 * tail_adam, (tail_zo, tail_adam)
