"""fp16.auto_cast: DeepSpeed's _cast_inputs_half (floating tensors in nested lists/tuples/dicts -> fp16)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from zerospeed.config import ConfigError, load_config
from zerospeed.precision.cast import cast_inputs_half

Pair = namedtuple("Pair", ["a", "b"])


def test_casts_floating_tensors_in_nested_containers() -> None:
    x32, x64, bf = torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.bfloat16)
    ids, mask = torch.arange(3), torch.ones(2, dtype=torch.bool)
    out = cast_inputs_half((x32, [x64, {"m": mask, "h": bf}], Pair(ids, x32), "text", 3.0, None))
    assert isinstance(out, tuple) and out[0].dtype == torch.float16
    assert isinstance(out[1], list) and out[1][0].dtype == torch.float16
    assert out[1][1]["h"].dtype == torch.float16 and out[1][1]["m"] is mask
    assert isinstance(out[2], Pair) and out[2].a is ids and out[2].b.dtype == torch.float16
    assert out[3:] == ("text", 3.0, None)
    assert torch.equal(out[0].float(), x32)


def test_auto_cast_needs_fp16_and_defaults() -> None:
    with pytest.raises(ConfigError, match="fp16.auto_cast"):
        load_config({"train_micro_batch_size_per_gpu": 1, "fp16": {"auto_cast": True}})
    cfg = load_config({"train_micro_batch_size_per_gpu": 1})
    assert cfg.fp16.auto_cast is False and cfg.fp16.raise_error_at_min_scale is True
    assert cfg.bf16.check_grad_overflow is True  # DeepSpeed >= 0.19.3


def test_deepspeed_bf16_master_keys_are_named_not_unknown() -> None:
    """DeepSpeed 0.19's bf16.bf16_master_weights_and_grads / bf16_optimizer_states: read with its meaning (issue 32;
    tests/dist/test_precision_variants.py), and its rule that the states key needs the master key."""
    from zerospeed.config import ConfigError

    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True, key: False}})
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {
        "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}})
    assert cfg.bf16.bf16_master_weights_and_grads and cfg.bf16.bf16_optimizer_states
    with pytest.raises(ConfigError, match="bf16.bf16_optimizer_states"):
        load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True, "bf16_optimizer_states": True}})
