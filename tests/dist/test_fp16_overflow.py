"""fp16: an inf gradient on one rank skips the step everywhere, halves the scale, leaves weights alone."""

import pytest
import torch

import zerospeed
from zerospeed import comm
from zerospeed.testing import run_distributed

from .parity import make_model, micro_batch


def _overflow_run(stage: int) -> list[dict]:
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage},
    }
    engine, opt, _, sched = zerospeed.initialize(model=model, config=config)
    log = []
    for step in range(5):
        x, y = micro_batch(step, 0, rank, world, 2, 1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        if step == 1 and rank == 1:
            handle = model.fc2.weight.register_hook(lambda g: g * float("inf"))
        loss = engine(x.half(), y.half())
        engine.backward(loss)
        engine.step()
        if step == 1 and rank == 1:
            handle.remove()
        changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        log.append({"scale": engine.loss_scale, "applied": engine.was_step_applied(), "changed": changed,
                    "lr": engine.get_lr()[0], "sched_iter": sched.last_batch_iteration,
                    "global_steps": engine.global_steps, "skipped": engine.skipped_steps})
    return log


def test_overflow_on_one_rank_skips_everywhere() -> None:
    for stage in (0, 2):
        logs = run_distributed(_overflow_run, 2, stage, timeout=120)
        assert logs[0] == logs[1], "both ranks must agree on every step"
        log = logs[0]
        assert log[0]["applied"] and log[0]["changed"] and log[0]["scale"] == 1024.0
        # step 2: inf on rank 1 only -> skipped on both ranks, weights untouched, scale halved
        assert not log[1]["applied"] and not log[1]["changed"]
        assert log[1]["scale"] == 512.0 and log[1]["skipped"] == 1 and log[1]["global_steps"] == 2
        # the schedule does not advance on a skipped step
        assert log[1]["sched_iter"] == log[0]["sched_iter"] and log[1]["lr"] == log[0]["lr"]
        # the scale grows again once loss_scale_window (2) clean steps have followed the overflow (DeepSpeed
        # >= 0.18: on the step where cur_iter - last_overflow_iter - 1 is a positive multiple of the window)
        assert log[2]["applied"] and log[2]["scale"] == 512.0
        assert log[3]["applied"] and log[3]["scale"] == 512.0
        assert log[4]["applied"] and log[4]["scale"] == 1024.0


def test_hysteresis_delays_the_cut() -> None:
    from zerospeed.precision import LossScaler

    s = LossScaler(2.0**8, dynamic=True, window=1000, hysteresis=2, min_scale=64, raise_error_at_min_scale=False)
    s.update(True)
    assert s.loss_scale == 256  # first overflow uses up hysteresis
    s.update(True)
    assert s.loss_scale == 128
    for _ in range(3):
        s.update(True)
    assert s.loss_scale == 64  # floored at min_loss_scale
    static = LossScaler(128.0, dynamic=False)
    static.update(True)
    assert static.loss_scale == 128.0


# --- at the minimum scale: raise (DeepSpeed's default), or keep skipping when told to ------------------
def test_scaler_raises_at_min_scale_after_hysteresis() -> None:
    from zerospeed.precision import LossScaleAtMinimumError, LossScaler

    s = LossScaler(4.0, dynamic=True, hysteresis=2, min_scale=1.0)
    trace = []
    for _ in range(3):  # the first overflow uses up hysteresis, the next ones cut
        s.update(True)
        trace.append(s.loss_scale)
    assert trace == [4.0, 2.0, 1.0]
    with pytest.raises(LossScaleAtMinimumError, match="fp16.raise_error_at_min_scale"):
        s.update(True)  # at 1.0 with hysteresis used up: DeepSpeed raises here
    at_min = LossScaler(1.0, dynamic=True, hysteresis=2, min_scale=1.0)
    at_min.update(True)  # hysteresis left: no cut, so no error yet
    with pytest.raises(LossScaleAtMinimumError):
        at_min.update(True)
    quiet = LossScaler(2.0, dynamic=True, hysteresis=1, min_scale=1.0, raise_error_at_min_scale=False)
    for _ in range(5):
        quiet.update(True)
    assert quiet.loss_scale == 1.0


def test_scaler_growth_matches_deepspeed_window() -> None:
    """DeepSpeed 0.19's DynamicLossScaler.update_scale, hand-traced: window 3, hysteresis 1, start 8."""
    from zerospeed.precision import LossScaler

    s = LossScaler(8.0, dynamic=True, window=3, hysteresis=1, min_scale=1.0)
    trace = []
    for overflow in (False, False, False, False, True, False, False, False, False, False, False, False):
        s.update(overflow)
        trace.append(s.loss_scale)
    # iters 0-2 stable_interval 0,1,2 -> no growth; iter 3: 3 -> x2; iter 4 overflow -> /2;
    # iters 5-7: 0,1,2; iter 8: 3 -> x2; iter 11: 6 -> x2
    assert trace == [8, 8, 8, 16, 8, 8, 8, 8, 16, 16, 16, 32]


def _min_scale_run(raise_key: bool | None, steps: int) -> dict:
    from zerospeed.precision import LossScaleAtMinimumError

    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model()
    fp16 = {"enabled": True, "initial_scale_power": 1, "hysteresis": 1, "min_loss_scale": 1}
    if raise_key is not None:
        fp16["raise_error_at_min_scale"] = raise_key
    config = {"train_micro_batch_size_per_gpu": 2, "fp16": fp16, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 1:  # every step overflows on rank 1 only
        model.fc2.weight.register_hook(lambda g: g * float("inf"))
    out: dict = {"error": None, "scales": []}
    try:
        for step in range(steps):
            x, y = micro_batch(step, 0, rank, world, 2, 1)
            engine.backward(engine(x.half(), y.half()))
            engine.step()
            out["scales"].append(engine.loss_scale)
    except LossScaleAtMinimumError as exc:
        out["error"] = str(exc)
    out["skipped"] = engine.skipped_steps
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    out["grads_released"] = all(g is None for g in engine.optimizer._fp32_grads)
    return out


def test_overflow_at_min_scale_raises_on_every_rank() -> None:
    for r in run_distributed(_min_scale_run, 2, None, 6, timeout=120):
        # scale 2 -> overflow, cut to 1 -> overflow at the minimum: a clear error instead of silent skips
        assert r["scales"] == [1.0] and r["error"] is not None
        assert "min_loss_scale" in r["error"] and "raise_error_at_min_scale" in r["error"]
        assert r["unchanged"] and r["grads_released"]


def test_overflow_at_min_scale_keeps_skipping_when_turned_off() -> None:
    for r in run_distributed(_min_scale_run, 2, False, 6, timeout=120):
        assert r["error"] is None and r["scales"] == [1.0] * 6
        assert r["skipped"] == 6 and r["unchanged"]
