"""MoE routing against DeepSpeed 0.19.8's own gating functions (fixtures from scripts/deepspeed_moe_reference.py)
and against the formulas worked by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from zerospeed.parallel.expert import gating
from zerospeed.parallel.expert.gate import TopKGate

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "deepspeed_moe_gating.json").read_text())


@pytest.mark.parametrize("case", FIXTURES["cases"], ids=[c["name"] for c in FIXTURES["cases"]])
def test_matches_deepspeed(case: dict) -> None:
    kw = dict(case["kwargs"])
    if "used_token" in kw:
        kw["used_token"] = torch.tensor(kw["used_token"])
    torch.manual_seed(case["seed"])
    l_aux, combine, dispatch, counts = getattr(gating, case["fn"])(torch.tensor(case["logits"]), **kw)
    assert combine.shape == torch.Size([len(x) for x in (case["combine"], case["combine"][0], case["combine"][0][0])])
    torch.testing.assert_close(combine, torch.tensor(case["combine"]), rtol=1e-6, atol=1e-7)
    assert dispatch.tolist() == case["dispatch"]
    assert counts.tolist() == case["exp_counts"]
    assert math.isclose(float(l_aux), case["l_aux"], rel_tol=1e-6)


def test_noise_draws_like_deepspeed() -> None:
    j = FIXTURES["jitter"]
    torch.manual_seed(j["seed"])
    torch.testing.assert_close(gating.multiplicative_jitter(torch.tensor(j["x"])), torch.tensor(j["out"]))
    g = FIXTURES["gumbel"]
    torch.manual_seed(g["seed"])
    torch.testing.assert_close(gating.gumbel_noise(torch.Size(g["shape"]), torch.device("cpu")), torch.tensor(g["out"]))


def test_capacity_formula() -> None:
    assert gating.capacity_for(10, 4, 1.0, 1) == 3          # ceil(2.5)
    assert gating.capacity_for(10, 4, 2.0, 1) == 5          # top-2 doubles the factor
    assert gating.capacity_for(10, 4, 0.1, 4) == 4          # min_capacity wins
    assert gating.capacity_for(0, 4, 1.0, 0) == 0


def test_top1_by_hand() -> None:
    # 5 tokens, 2 experts; everyone prefers expert 0, capacity = max(ceil(5/2*0.4), 1) = 1
    logits = torch.tensor([[2.0, 0.0], [3.0, 0.0], [1.0, 0.0], [0.0, 1.0], [4.0, 0.0]])
    r = gating.route_top1(logits, capacity_factor=0.4, min_capacity=1, use_rts=False)
    assert r.capacity == 1
    assert r.exp_counts.tolist() == [4, 1]                   # counted before dropping
    gates = torch.softmax(logits, dim=1)
    me = gates.mean(0)
    ce = torch.tensor([4 / 5, 1 / 5])
    assert math.isclose(float(r.l_aux), float((me * ce).sum() * 2), rel_tol=1e-6)
    kept0 = [t for t in range(5) if r.expert[0, t] == 0]
    assert len(kept0) == 1 and r.expert[0, 3] == 1 and r.location[0, 3] == 0
    assert float(r.gate[0, 3]) == pytest.approx(float(gates[3, 1]))  # top-1 weights are not renormalised


def test_top2_second_choice_queues_after_firsts_and_renormalises() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [0.0, 3.0, 2.0]])
    r = gating.route_top2(logits, capacity_factor=10.0, min_capacity=1, top2_2nd_expert_sampling=False)
    assert r.expert.tolist() == [[0, 0, 1], [1, 2, 2]]
    # expert 1 holds token 2 first (location 0), then token 0's second choice after all firsts (location 1)
    assert r.location.tolist() == [[0, 1, 0], [1, 0, 1]]
    torch.testing.assert_close(r.gate.sum(0), torch.ones(3))
    gates = torch.softmax(logits, dim=1)
    assert float(r.l_aux) == pytest.approx(float((gates.mean(0) * torch.tensor([2 / 3, 1 / 3, 0])).mean() * 9))


def test_topk_drop_policies_differ() -> None:
    # 4 tokens all want expert 0; capacity 1. 'position' keeps the first, 'probs' the most confident (token 3).
    logits = torch.tensor([[1.0, 0.0, -9.0], [1.5, 0.0, -9.0], [2.0, 0.0, -9.0], [5.0, 0.0, -9.0]])
    pos = gating.route_topk(logits, 1, capacity_factor=0.75, min_capacity=1, drop_policy="position")
    probs = gating.route_topk(logits, 1, capacity_factor=0.75, min_capacity=1, drop_policy="probs")
    assert pos.expert[0].tolist() == [0, -1, -1, -1]
    assert probs.expert[0].tolist() == [-1, -1, -1, 0]
    with pytest.raises(ValueError, match="drop_policy"):
        gating.route_topk(logits, 1, 1.0, 1, drop_policy="random")


def test_no_drop_capacity_fits_busiest_expert() -> None:
    logits = torch.tensor([[5.0, 0.0]] * 7 + [[0.0, 5.0]])
    r = gating.route_top1(logits, capacity_factor=0.1, min_capacity=1, drop_tokens=False, use_rts=False)
    assert r.capacity == 7 and bool((r.expert[0] >= 0).all())


def test_small_batch_routes_without_error() -> None:
    """Fewer tokens than min_capacity (even none) still routes: a rank with few tokens must not fail."""
    for s in (0, 1):
        r = gating.route_top1(torch.zeros(s, 4), 1.0, 4, use_rts=True)
        assert r.capacity == 4 and r.expert.shape == (1, s)
        r2 = gating.route_top2(torch.zeros(s, 4), 1.0, 4)
        assert r2.expert.shape == (2, s)


def test_gate_module_train_eval_and_jitter() -> None:
    torch.manual_seed(0)
    gate = TopKGate(6, 4, k=1, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=1,
                    noisy_gate_policy="Jitter", use_rts=False)
    x = torch.randn(8, 6)
    assert gate.route(x).capacity == 1
    gate.eval()
    a, b = gate.route(x), gate.route(x)                      # no noise in eval
    assert a.capacity == 4 and torch.equal(a.gate, b.gate)
    gate.train()
    torch.manual_seed(1)
    c = gate.route(x).gate
    torch.manual_seed(2)
    assert not torch.equal(c, gate.route(x).gate)            # jitter moves the weights in training
    l_aux, combine, mask, counts = gate(x)
    assert combine.shape == (8, 4, 1) and mask.dtype == torch.bool
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        TopKGate(6, 4, noisy_gate_policy="gaussian")
