"""The MoE layer at ep=1 against DeepSpeed 0.19.8's MoE (same weights, input; fixture), and the param helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerospeed.moe.layer import MoE
from zerospeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "deepspeed_moe_gating.json").read_text())


def _expert() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(), torch.nn.Linear(10, 6))


@pytest.mark.parametrize("case", FIXTURES["layers"], ids=[c["name"] for c in FIXTURES["layers"]])
def test_layer_matches_deepspeed(case: dict) -> None:
    moe = MoE(6, _expert(), num_experts=4, **case["kwargs"])
    moe.load_state_dict({k: torch.tensor(v) for k, v in case["state"].items()})   # DeepSpeed's parameter names
    x = torch.tensor(case["x"], requires_grad=True)
    y, l_aux, counts = moe(x)
    torch.testing.assert_close(y, torch.tensor(case["y"]), rtol=1e-5, atol=1e-6)
    assert float(l_aux.detach()) == pytest.approx(case["l_aux"], rel=1e-6)
    assert counts.tolist() == case["exp_counts"]
    w = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    ((y * w).sum() + l_aux).backward()
    torch.testing.assert_close(x.grad, torch.tensor(case["x_grad"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.deepspeed_moe.gate.wg.weight.grad, torch.tensor(case["wg_grad"]), rtol=1e-5,
                               atol=1e-6)


def test_dropped_tokens_give_zero_output() -> None:
    torch.manual_seed(0)
    moe = MoE(6, _expert(), num_experts=2, k=1, capacity_factor=0.01, min_capacity=1, use_rts=False)
    y, _, counts = moe(torch.randn(10, 6))
    assert int(counts.sum()) == 10
    assert int((y.abs().sum(dim=1) > 0).sum()) == 2            # one slot per expert: two tokens processed


def test_expert_params_tagged_and_split_into_groups() -> None:
    moe = MoE(6, _expert(), num_experts=4, ep_size=2, k=1)
    experts = [p for p in moe.parameters() if is_moe_param(p)]
    assert len(experts) == 2 * 4                               # 2 local experts x (2 weights + 2 biases)
    assert {p.group_name for p in experts} == {"ep_size_2"}
    assert not is_moe_param(moe.deepspeed_moe.gate.wg.weight)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(moe.parameters()), "name": "dense", "lr": 0.1}, max_group_size=100)
    assert [g["name"] for g in groups][0] == "dense" and len(groups[0]["params"]) == 1
    moe_groups = groups[1:]
    assert all(g["moe"] and g["name"] == "ep_size_2" and g["lr"] == 0.1 for g in moe_groups)
    assert sum(len(g["params"]) for g in moe_groups) == 8
    assert all(sum(p.numel() for p in g["params"]) <= 100 for g in moe_groups) and len(moe_groups) > 1
    with pytest.raises(ValueError, match="name"):
        split_params_into_different_moe_groups_for_optimizer({"params": experts})


def test_ep_without_group_and_bad_args_fail_loudly() -> None:
    moe = MoE(6, _expert(), num_experts=4, ep_size=2)
    with pytest.raises(RuntimeError, match="set_deepspeed_parallelism"):
        moe(torch.randn(4, 6))
    with pytest.raises(ValueError, match="divisible"):
        MoE(6, _expert(), num_experts=3, ep_size=2)
    with pytest.raises(NotImplementedError, match="not supported yet by zerospeed"):
        MoE(6, _expert(), num_experts=4, use_tutel=True)


def test_deepspeed_import_paths() -> None:
    from zerospeed.moe.experts import Experts
    from zerospeed.moe.sharded_moe import MOELayer, TopKGate, top1gating, top2gating, topkgating
    from zerospeed.parallel.expert import gating, layer

    assert (top1gating, top2gating, topkgating) == (gating.top1gating, gating.top2gating, gating.topkgating)
    assert MOELayer is layer.MOELayer and TopKGate.__module__.endswith("expert.gate")
    assert isinstance(MoE(6, _expert(), num_experts=2).deepspeed_moe.experts, Experts)
