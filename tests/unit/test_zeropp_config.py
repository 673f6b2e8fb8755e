"""ZeRO++ keys: DeepSpeed's names and defaults, accepted switched on, a warning below stage 3 (where they act not)."""

from __future__ import annotations

import logging

import pytest

from zerospeed.config import load_config


def test_defaults_are_deepspeeds() -> None:
    z = load_config({"train_batch_size": 8}, 2).zero_optimization
    assert z.zero_hpz_partition_size == 1 and z.zero_quantized_gradients is False


def test_accepted_at_stage3_and_warned_below(caplog: pytest.LogCaptureFixture) -> None:
    on = {"zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
    with caplog.at_level(logging.WARNING, logger="zerospeed.config"):
        z = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, **on}}, 2).zero_optimization
    assert z.zero_hpz_partition_size == 2 and z.zero_quantized_gradients and not caplog.records
    with caplog.at_level(logging.WARNING, logger="zerospeed.config"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, **on}}, 2)
    assert "no effect at ZeRO stage 2" in caplog.text
