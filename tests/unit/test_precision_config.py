"""The precision variants' config without processes: torch_autocast's keys, module list, region and errors;
DeepSpeed's rules for 16-bit master weights and bf16 optimizer states."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.config import ConfigError, load_config
from zerospeed.config.errors import NotSupportedYetError
from zerospeed.precision import AutocastRegion, make_policy
from zerospeed.runtime.plan import ModelFacts, OptimizerFacts, plan_training


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


def _plan(stage: int, **extra: dict) -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                       "zero_optimization": {"stage": stage, **extra.pop("zero", {})}, **extra})
    plan_training(cfg, ModelFacts(optimizer=OptimizerFacts(client=False)))


BF16_MASTER = {"enabled": True, "bf16_master_weights_and_grads": True}


@pytest.mark.parametrize(("stage", "extra", "key", "kind"), [
    (2, {"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states", ConfigError),
    (0, {"bf16": BF16_MASTER}, "bf16.bf16_master_weights_and_grads", ConfigError),
    (2, {"bf16": {"bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads", ConfigError),
    (2, {"bf16": BF16_MASTER}, "bf16.bf16_master_weights_and_grads", ConfigError),  # fp32 state needs CPU offload
    (2, {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads",
     ConfigError),
    (3, {"bf16": {**BF16_MASTER, "bf16_optimizer_states": True}}, "bf16.bf16_master_weights_and_grads",
     NotSupportedYetError),
    (2, {"bf16": BF16_MASTER, "data_types": {"grad_accum_dtype": "fp32"}, "zero": {"offload_optimizer": {
        "device": "cpu"}}}, "data_types.grad_accum_dtype", ConfigError),
    (2, {"data_types": {"grad_accum_dtype": "int8"}}, "data_types.grad_accum_dtype", ConfigError),
    (2, {"bf16": BF16_MASTER, "zero": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "bf16.bf16_master_weights_and_grads", NotSupportedYetError),
])
def test_master_weight_rules_name_the_key(stage: int, extra: dict, key: str, kind: type) -> None:
    with pytest.raises(kind) as info:
        _plan(stage, **extra)
    assert info.value.key == key


def test_master_weight_dtypes_of_the_policy() -> None:
    _plan(2, bf16=BF16_MASTER, zero={"offload_optimizer": {"device": "cpu"}})  # accepted
    _plan(1, bf16={**BF16_MASTER, "bf16_optimizer_states": True})
    plain, master = make_policy(False, True, None), make_policy(False, True, None, None, True, True)
    acc = make_policy(False, True, None, grad_accum=torch.bfloat16)
    assert (acc.accum, acc.comm, acc.master) == (torch.bfloat16, torch.bfloat16, torch.float32)
    assert (plain.master, plain.accum, plain.states) == (torch.float32, torch.float32, torch.float32)
    assert (master.master, master.accum, master.comm, master.states) == (torch.bfloat16,) * 4


def test_fp16_autocast_scaler_follows_torch_grad_scaler() -> None:
    """Against torch.amp.GradScaler itself: the same scale after the same overflow pattern."""
    from zerospeed.precision import GradScalerRule

    ours, theirs = GradScalerRule(growth_interval=3), torch.amp.GradScaler("cpu", growth_interval=3)
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    for overflow in [False, False, False, True, False, False, False, False, True, True, False]:
        theirs.scale(p.sum()).backward()
        if overflow:
            p.grad.fill_(float("inf"))
        theirs.step(opt)
        theirs.update()
        opt.zero_grad()
        ours.update(overflow)
        assert ours.loss_scale == theirs.get_scale()
    restored = GradScalerRule(growth_interval=3)
    restored.load_state_dict(ours.state_dict())
    assert restored.growth_tracker == ours.growth_tracker and restored.loss_scale == ours.loss_scale
