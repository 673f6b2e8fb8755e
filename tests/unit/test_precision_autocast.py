"""torch_autocast's config and region without processes: DeepSpeed's keys, module list and errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.config import ConfigError, load_config
from zerospeed.precision import AutocastRegion


def _region(section: dict) -> AutocastRegion:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "torch_autocast": section})
    return AutocastRegion.from_config(cfg.torch_autocast, "cpu")


def test_keys_dtype_and_default_module_list() -> None:
    region = _region({"enabled": True, "dtype": "bfloat16"})
    assert region.enabled and region.dtype == torch.bfloat16
    assert region.safe_module_names == ["torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
                                        "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d"]
    assert _region({"enabled": True}).dtype == torch.get_autocast_dtype("cpu")  # torch.autocast's default
    with pytest.raises(ConfigError, match="torch_autocast.dtype"):
        _region({"enabled": True, "dtype": "int8"})


def test_module_list_is_imported_and_matches_exact_classes() -> None:
    region = _region({"enabled": True, "lower_precision_safe_modules": ["torch.nn.modules.linear.Linear"]})

    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(2, 2), MyLinear(2, 2), nn.LayerNorm(2))
    assert region.safe_parameters(model) == list(model[0].parameters())
    with pytest.raises(ConfigError, match="torch_autocast.lower_precision_safe_modules.*NoSuchLinear"):
        _region({"enabled": True, "lower_precision_safe_modules": ["torch.nn.NoSuchLinear"]})
    with pytest.raises(ConfigError, match="torch_autocast"):
        _region({"enabled": True, "lower_precision_safe_modules": "torch.nn.Linear"})


def test_region_nesting_follows_deepspeed() -> None:
    on, off = _region({"enabled": True, "dtype": "bf16"}), _region({"enabled": False})
    x, w = torch.randn(2, 2), torch.randn(2, 2)
    with on.region():
        assert (x @ w).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16), off.region():
        assert (x @ w).dtype == torch.float32
    with off.region():
        assert (x @ w).dtype == torch.float32
