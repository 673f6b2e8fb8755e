"""A Hugging Face model's own ``tp_plan`` as AutoTP rules (parallel/tensor/hf_tp_plan.py, no processes): the merge
of config, class and instance plans, the styles it turns into rules, and the plan placing what the built-in
rules would refuse."""

from __future__ import annotations

import pytest
from torch import nn

from zerospeed.parallel.tensor.autotp_config import PartitionType
from zerospeed.parallel.tensor.hf_tp_plan import hf_tp_plan, plan_config, specs_from_hf_plan
from zerospeed.parallel.tensor.policy import plan_model


class _Config:
    base_model_tp_plan = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)


class _Model(nn.Module):
    _tp_plan = {"proj": "colwise_gather_output"}  # a class-level entry, as transformers' lm_head

    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()
        self.layers = nn.ModuleList([_Block()])
        self.proj = nn.Linear(4, 6)  # outside every block, not a head name: the built-in rules refuse it


def test_the_plans_merge_and_prefixed_repeats_add_nothing() -> None:
    model = _Model()
    model._tp_plan = {"model.layers.*.up": "colwise", "extra": "rowwise"}  # what transformers may set on an instance
    assert hf_tp_plan(model) == {"layers.*.up": "colwise", "layers.*.down": "rowwise",
                                 "proj": "colwise_gather_output", "extra": "rowwise"}
    assert hf_tp_plan(nn.Linear(2, 2)) is None


def test_the_plan_places_layers_the_built_in_rules_refuse() -> None:
    with pytest.raises(ValueError, match="proj"):
        plan_model(_Model())
    plan = plan_model(_Model(), plan_config(_Model(), 2))
    assert (plan["layers.0.up"].kind, plan["layers.0.down"].kind) == (PartitionType.COLUMN, PartitionType.ROW)
    assert plan["proj"].kind == PartitionType.COLUMN and plan["proj"].gather_output


def test_a_style_autotp_cannot_apply_leaves_the_built_in_rules() -> None:
    assert specs_from_hf_plan({"layers.*.up": "colwise", "layers.*.experts": "moe_tp_experts"}) is None
    spec, = specs_from_hf_plan({"layers.*.norm": "replicated_with_grad_allreduce"})
    assert spec.partition_type == PartitionType.SKIP and spec.grad_allreduce
    assert spec.patterns == [r".*layers\..*\.norm\.weight$"]
