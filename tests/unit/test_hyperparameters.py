"""One rule for optimizer and scheduler hyper-parameters (issue 31, item 6): each meaningless value that used
to be trained on (NaN parameters after 3 steps, every step skipped, a negative lr) is a ConfigError naming
its key."""

from __future__ import annotations

import pytest
import torch

from zerospeed.config import ConfigError
from zerospeed.optim.factory import build_optimizer
from zerospeed.optim.schedules.factory import build_scheduler

INF, NAN = float("inf"), float("nan")


def _groups() -> list[dict]:
    return [{"params": [torch.nn.Parameter(torch.zeros(3))]}]


@pytest.mark.parametrize("opt, params, key", [
    ("AdamW", {"lr": INF}, "optimizer.params.lr"),
    ("AdamW", {"lr": 1e30}, "optimizer.params.lr"),
    ("AdamW", {"lr": "inf"}, "optimizer.params.lr"),
    ("Adam", {"weight_decay": INF}, "optimizer.params.weight_decay"),
    ("Adam", {"eps": 0}, "optimizer.params.eps"),
    ("Adam", {"betas": [0.9, 1.0]}, "optimizer.params.betas"),
    ("Lamb", {"lr": -1e-3}, "optimizer.params.lr"),
    ("SGD", {"lr": 0.1, "momentum": INF}, "optimizer.params.momentum"),
    ("SGD", {"lr": 0.1, "momentum": 1.5}, "optimizer.params.momentum"),
    ("Adagrad", {"lr": INF}, "optimizer.params.lr"),
])
def test_optimizer_hyperparameters(opt: str, params: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_optimizer(opt, params, _groups())
    assert info.value.key == key, str(info.value)


@pytest.mark.parametrize("sched, params, key", [
    ("WarmupLR", {"warmup_max_lr": INF}, "scheduler.params.warmup_max_lr"),
    ("WarmupLR", {"warmup_max_lr": NAN}, "scheduler.params.warmup_max_lr"),
    ("WarmupLR", {"warmup_min_lr": -1}, "scheduler.params.warmup_min_lr"),
    ("WarmupLR", {"warmup_min_lr": [0.0, -1.0]}, "scheduler.params.warmup_min_lr"),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": 1e30}, "scheduler.params.warmup_max_lr"),
    ("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": INF}, "scheduler.params.cycle_max_lr"),
    ("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1, "cycle_max_mom": 2.0}, "scheduler.params.cycle_max_mom"),
    ("LRRangeTest", {"lr_range_test_min_lr": -0.1}, "scheduler.params.lr_range_test_min_lr"),
])
def test_scheduler_hyperparameters(sched: str, params: dict, key: str) -> None:
    opt = build_optimizer("AdamW", {"lr": 1e-3}, _groups())
    with pytest.raises(ConfigError) as info:
        build_scheduler(sched, params, opt)
    assert info.value.key == key, str(info.value)


@pytest.mark.parametrize("value", [INF, NAN, 1e40])
def test_fp16_loss_scale_must_be_finite(value: float) -> None:
    from zerospeed.config import load_config as parse_config

    with pytest.raises(ConfigError, match="fp16.loss_scale"):
        parse_config({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, "loss_scale": value}})


def test_meaningful_values_still_build() -> None:
    opt = build_optimizer("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.0}, _groups())
    build_scheduler("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 3}, opt)
    build_optimizer("AdamW", {"lr": 1e-3, "betas": [0.0, 0.999], "eps": 1e-8}, _groups())
