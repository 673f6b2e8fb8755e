"""``timers.throughput`` and ``log_level`` through the engine (one rank): a disabled throughput timer records
no step (DeepSpeed's ``avg_samples_per_sec()`` stays ``-inf``), the default one counts every step, and
``log_level`` sets the ``zerospeed`` logger before the engine's own start-up messages."""

from __future__ import annotations

import logging
from typing import Any

import torch

from zerospeed.testing import run_distributed


def _train(extra: dict[str, Any]) -> Any:
    import zerospeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}
    engine, *_ = zerospeed.initialize(model=torch.nn.Linear(4, 1), config=config)
    for _ in range(3):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    return engine


def _ranks() -> dict[str, Any]:
    logger = logging.getLogger("zerospeed")
    handler = logging.StreamHandler()
    logger.addHandler(handler)
    try:
        off = _train({"timers": {"throughput": {"enabled": False}}, "log_level": "error"})
        levels = (logger.level, handler.level)
        on = _train({"timers": {"throughput": {"synchronized": False}}, "log_level": "Debug"})
    finally:
        logger.removeHandler(handler)
    return {"off": (off.tput_timer.global_step_count, off.tput_timer.avg_samples_per_sec()),
            "on": (on.tput_timer.global_step_count, on.tput_timer.avg_samples_per_sec() > 0),
            "levels": levels, "debug": logger.level}


def test_throughput_timer_switch_and_log_level_in_the_engine() -> None:
    (got,) = run_distributed(_ranks, 1, timeout=60)
    assert got["off"] == (0, float("-inf"))
    assert got["on"] == (3, True)
    assert got["levels"] == (logging.ERROR, logging.ERROR) and got["debug"] == logging.DEBUG
