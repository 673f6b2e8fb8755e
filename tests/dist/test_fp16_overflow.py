"""fp16: an inf gradient on one rank skips the step everywhere, halves the scale, leaves weights alone."""

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
        # the scale grows again after loss_scale_window (2) clean steps
        assert log[2]["applied"] and log[2]["scale"] == 512.0
        assert log[3]["applied"] and log[3]["scale"] == 1024.0


def test_hysteresis_delays_the_cut() -> None:
    from zerospeed.precision import LossScaler

    s = LossScaler(2.0**8, dynamic=True, window=1000, hysteresis=2, min_scale=64)
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
