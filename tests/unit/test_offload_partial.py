"""Partial offload's split is DeepSpeed's: sub-group ``i`` stays on the device when ``i < int((1 - ratio) * n)``."""

from __future__ import annotations

import pytest

from zerospeed.config import ConfigError, load_config
from zerospeed.offload.partial import split_subgroups
from zerospeed.offload.subgroups import SubGroup


@pytest.mark.parametrize("n,ratio,on_device", [(10, 1.0, 0), (10, 0.0, 10), (10, 0.3, 7), (3, 0.5, 1), (7, 0.9, 0),
                                               (4, 0.25, 3)])
def test_split_follows_deepspeed(n: int, ratio: float, on_device: int) -> None:
    jobs = [SubGroup(0, i, i * 10, i * 10 + 10) for i in range(n)]
    device, host = split_subgroups(jobs, ratio)
    assert [sg.index for sg in device] == list(range(on_device))  # the first ones stay, in order
    assert [sg.index for sg in host] == list(range(on_device, n))


def test_ratio_key() -> None:
    off = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.0}}}, 2).zero_optimization.offload_optimizer
    assert off.ratio == 0.0  # DeepSpeed's range is [0, 1]
    with pytest.raises(ConfigError, match="ratio"):
        load_config({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": -0.1}}}, 2)
