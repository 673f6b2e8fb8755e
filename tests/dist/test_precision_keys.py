"""fp16.auto_cast through the engine; bf16.check_grad_overflow skips a step with an inf gradient on one rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zerospeed
from zerospeed import comm
from zerospeed.testing import run_distributed

from .parity import make_model, micro_batch


def _auto_cast_run(auto_cast: bool) -> dict[str, Any]:
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model()
    seen: list[Any] = []
    model.fc1.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    config = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "auto_cast": auto_cast},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    x, y = micro_batch(0, 0, rank, world, 2, 1)  # fp32 inputs, as a data loader gives them
    try:
        loss = engine(x, y)
    except RuntimeError as exc:  # fp16 weights meet fp32 inputs
        return {"error": str(exc), "seen": [str(d) for d in seen]}
    engine.backward(loss)
    engine.step()
    return {"error": None, "seen": [str(d) for d in seen], "loss_dtype": str(loss.dtype),
            "applied": engine.was_step_applied()}


def test_fp16_auto_cast_casts_inputs() -> None:
    for r in run_distributed(_auto_cast_run, 2, True, timeout=120):
        assert r["error"] is None and r["seen"] == ["torch.float16"] and r["loss_dtype"] == "torch.float16"
    for r in run_distributed(_auto_cast_run, 2, False, timeout=120):
        assert r["error"] is not None and r["seen"] == ["torch.float32"]


def _bf16_inf_run(stage: int, check: bool | None) -> dict[str, Any]:
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model()
    bf16: dict[str, Any] = {"enabled": True}
    if check is not None:
        bf16["check_grad_overflow"] = check
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": bf16, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                           "warmup_num_steps": 5}},
              "zero_optimization": {"stage": stage}}
    engine, opt, _, sched = zerospeed.initialize(model=model, config=config)
    log = []
    for step in range(3):
        x, y = micro_batch(step, 0, rank, world, 2, 1)
        before = {k: v.float().clone() for k, v in model.state_dict().items()}
        handle = None
        if step == 1 and rank == 1:
            handle = model.fc2.weight.register_hook(lambda g: g * float("inf"))
        engine.backward(engine(x.bfloat16(), y.bfloat16()))
        engine.step()
        if handle is not None:
            handle.remove()
        after = {k: v.float() for k, v in model.state_dict().items()}
        log.append({"applied": engine.was_step_applied(), "skipped": engine.skipped_steps,
                    "changed": any(not torch.equal(before[k], v) for k, v in after.items()),
                    "finite": all(bool(torch.isfinite(v).all()) for v in after.values()),
                    "scale": engine.loss_scale, "sched_iter": sched.last_batch_iteration})
    return {"log": log, "state": {k: v.float().clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_check_grad_overflow_skips_on_every_rank(stage: int) -> None:
    results = run_distributed(_bf16_inf_run, 2, stage, None, timeout=180)  # the default is on (DeepSpeed 0.19.3+)
    assert results[0]["log"] == results[1]["log"], "both ranks must agree on every step"
    for k, v in results[0]["state"].items():
        torch.testing.assert_close(results[1]["state"][k], v, rtol=0, atol=0)
    log = results[0]["log"]
    assert log[0]["applied"] and log[0]["changed"]
    assert not log[1]["applied"] and not log[1]["changed"] and log[1]["skipped"] == 1
    assert log[1]["scale"] == 1.0 and log[1]["sched_iter"] == log[0]["sched_iter"]  # no scale, no schedule step
    assert log[2]["applied"] and log[2]["changed"] and log[2]["finite"]


def test_bf16_without_check_applies_the_step() -> None:
    """check_grad_overflow false: the previous behaviour, the non-finite gradient reaches the weights."""
    for r in run_distributed(_bf16_inf_run, 2, 2, False, timeout=180):
        log = r["log"]
        assert log[1]["applied"] and log[1]["skipped"] == 0 and not log[1]["finite"]
