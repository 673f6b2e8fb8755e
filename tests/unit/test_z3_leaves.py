"""DeepSpeed's ZeRO-3 leaf-module API (deepspeed.utils paths) and the granularity rule, without processes."""

from __future__ import annotations

import logging

import pytest
from torch import nn

from zerospeed.config import load_config
from zerospeed.utils import (get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module)
from zerospeed.utils.z3_leaf_module import (set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                                            z3_leaf_parameter)
from zerospeed.zero.stage3.leaves import INFINITE, granularities, granularity_leaves


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)  # 20
        self.b = nn.Linear(4, 2, bias=False)  # 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.act = nn.GELU()
        self.head = nn.Linear(4, 100)  # 500


def test_set_get_unset_by_class_object_short_and_qualified_name() -> None:
    net = Net()
    assert set_z3_leaf_modules(net, [Block]) == list(net.blocks)
    assert get_z3_leaf_modules(net) == list(net.blocks) and z3_leaf_module(net.blocks[0])
    assert z3_leaf_parameter(net.blocks[1].a.weight, net) and not z3_leaf_parameter(net.head.weight, net)
    with pytest.raises(TypeError, match="pass the model"):
        z3_leaf_parameter(net.head.weight)
    assert unset_z3_leaf_modules(net, ["Block"]) == list(net.blocks) and get_z3_leaf_modules(net) == []
    set_z3_leaf_modules(net, [f"{Block.__module__}.Block"])
    assert get_z3_leaf_modules(net) == list(net.blocks)
    with pytest.raises(ValueError, match="no modules of type"):
        set_z3_leaf_modules(net, ["Missing"])
    assert set_z3_leaf_modules(net, ["Missing"], raise_if_not_found=False) == []


def test_by_name_and_by_suffix_report_what_they_missed() -> None:
    net = Net()
    found, missing = set_z3_leaf_modules_by_name(net, ["blocks.1", "nope"], raise_if_not_found=False)
    assert found == [net.blocks[1]] and missing == ["nope"]
    found, missing = set_z3_leaf_modules_by_suffix(net, [".a", "zzz"], raise_if_not_found=False)
    assert found == [net.blocks[0].a, net.blocks[1].a] and missing == ["zzz"]
    with pytest.raises(ValueError, match="no modules named"):
        set_z3_leaf_modules_by_name(net, ["nope"])


def test_granularity_is_deepspeeds_rule() -> None:
    net = Net()
    g = granularities(net)
    assert g[id(net.blocks[0])] == 28 // 3  # 28 parameters over its 2 linears and itself
    assert g[id(net.blocks)] == INFINITE and g[id(net.act)] == INFINITE and g[id(net.head)] == INFINITE
    assert g[id(net)] == 556 // 8  # 2 blocks (3 each; the ModuleList adds none, GELU none), head 1, itself 1
    assert granularity_leaves(net, 9) == list(net.blocks)  # the root (69) is above 9: its children are tried
    assert granularity_leaves(Net(), 100)[0].__class__ is Net  # the root first
    assert granularity_leaves(Net(), 0) == []


def test_a_threshold_below_every_granularity_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zerospeed.zero"):
        assert granularity_leaves(Net(), 5) == []
    assert "smallest module granularity is 9" in caplog.text


def test_leaf_module_config_defaults_and_coercion() -> None:
    zero = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}).zero_optimization
    assert "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock" in zero.leaf_module.classes
    zero = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "leaf_module": {"classes": "A", "names": ["x", "x"]},
        "stage3_module_granularity_threshold": 10}}).zero_optimization
    assert zero.leaf_module.classes == ["A"] and zero.leaf_module.names == ["x"]
    assert zero.stage3_module_granularity_threshold == 10


def test_mics_sizes_are_checked_before_any_group_is_made() -> None:
    from zerospeed.config import ConfigError
    from zerospeed.zero.stage3.mics import mics_groups

    assert mics_groups(-1, False, None, False) is None  # DeepSpeed's default: off
    with pytest.raises(ConfigError, match="mics_shard_size 3 must be >= 1 and divide"):
        mics_groups(3, False, None, False)
    with pytest.raises(ConfigError, match="needs mics_shard_size >= 1"):
        mics_groups(-1, True, None, False)
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}}).zero_optimization
    assert (cfg.mics_shard_size, cfg.mics_hierarchical_params_gather) == (2, True)


def test_legacy_stage1_is_read_as_stage1_only() -> None:
    from zerospeed.config import ConfigError

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1, "legacy_stage1": True}})
    assert cfg.zero_stage == 1 and cfg.zero_optimization.legacy_stage1
    from zerospeed.runtime.facts import ModelFacts
    from zerospeed.runtime.plan import plan_training

    two = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "legacy_stage1": True}})
    with pytest.raises(ConfigError, match="legacy_stage1 is DeepSpeed's old ZeRO stage 1: it needs stage 1") as info:
        plan_training(two, ModelFacts())
    assert info.value.key == "zero_optimization.legacy_stage1"


def test_pipeline_loading_checkpoint_is_read_under_stage3_only() -> None:
    from zerospeed.config import ConfigError
    from zerospeed.runtime.checkpoint.turns import turn_of
    from zerospeed.runtime.facts import ModelFacts
    from zerospeed.runtime.plan import plan_training

    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "zero_optimization": {"stage": 3, "pipeline_loading_checkpoint": True}})
    assert cfg.zero_optimization.pipeline_loading_checkpoint
    plan_training(cfg, ModelFacts())
    two = load_config({"train_micro_batch_size_per_gpu": 1,
                       "zero_optimization": {"stage": 2, "pipeline_loading_checkpoint": True}})
    with pytest.raises(ConfigError, match="only for ZeRO stage 3, as in DeepSpeed") as info:
        plan_training(two, ModelFacts())
    assert info.value.key == "zero_optimization.pipeline_loading_checkpoint"
    # two nodes of three ranks: local rank 0 of each node reads first, in the same turn
    assert [turn_of(r, 6, 3) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="must divide"):
        turn_of(0, 6, 4)


def test_disable_allgather_true_says_it_has_no_effect(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zerospeed.config"):
        assert load_config({"train_micro_batch_size_per_gpu": 1, "disable_allgather": True}).disable_allgather
    assert "disable_allgather: true has no effect" in caplog.text
