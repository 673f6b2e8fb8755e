"""The fp16 section's value rules (config/precision.py): numbers only, and the dynamic-scaling fields checked
only where dynamic scaling uses them."""

from __future__ import annotations

import pytest

from zerospeed.config import ConfigError, load_config


def _fp16(**section: object) -> object:
    return load_config({"train_batch_size": 1, "fp16": section}).fp16


@pytest.mark.parametrize("section", [{"loss_scale": True}, {"loss_scale": [1]}, {"min_loss_scale": True},
                                     {"enabled": True, "loss_scale_window": 0},
                                     {"enabled": True, "min_loss_scale": -1.0}])
def test_refused(section: dict) -> None:
    with pytest.raises(ConfigError, match="fp16"):
        _fp16(**section)


def test_unused_dynamic_fields_are_not_checked() -> None:
    assert _fp16(enabled=True, loss_scale=128, loss_scale_window=0).loss_scale_window == 0  # static scale
    assert _fp16(enabled=False, min_loss_scale=-1.0).min_loss_scale == -1.0  # fp16 off
    assert _fp16(loss_scale="3").loss_scale == 3.0
