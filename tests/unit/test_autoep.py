"""AutoEP without processes: HF MoE blocks found by structure (user names first), the experts' computation
replaced with HF's loss and gradients unchanged at ep=1, grouped matmul = per-expert loop, config refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.config import ConfigError, load_config
from zerospeed.config.errors import NotSupportedYetError
from zerospeed.config.expert_parallel import ExpertParallelConfig
from zerospeed.parallel.expert.auto import AutoEPExperts, autoep_model, find_moe_blocks
from zerospeed.parallel.expert.auto.grouped import grouped_available, grouped_mm

from tests.dist.autoep_fixtures import batch, loss_of, tiny_moe


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_ep1_keeps_the_hf_loss_and_gradients(family: str) -> None:
    plain, auto = tiny_moe(family), tiny_moe(family)
    specs = autoep_model(ExpertParallelConfig(enabled=True), auto)
    assert [s.name for s in specs] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert (specs[0].num_experts, specs[0].hidden, specs[0].intermediate, specs[0].w3) == (4, 16, 12, None)
    assert isinstance(auto.model.layers[1].mlp.experts, AutoEPExperts)
    names = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in auto.named_parameters()] == names  # HF's names: checkpoints stay HF-shaped
    _same_loss_and_grads(plain, auto)


class _Experts(nn.Module):
    def __init__(self, e: int, h: int, i: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(e, i, h))
        self.w_up = nn.Parameter(torch.randn(e, i, h))
        self.w_out = nn.Parameter(torch.randn(e, h, i))
        self.act_fn = torch.nn.functional.silu


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.bank = _Experts(4, 8, 6)


def test_user_names_take_precedence_over_the_defaults() -> None:
    model = nn.Sequential(_Block(), _Block())
    assert find_moe_blocks(model, ExpertParallelConfig(enabled=True)) == []  # not HF's names
    cfg = ExpertParallelConfig(enabled=True, router_pattern="router", expert_pattern="bank", expert_w1="w_in",
                               expert_w2="w_out", expert_w3="w_up", moe_layer_pattern=r"1")
    (spec,) = find_moe_blocks(model, cfg)
    assert (spec.name, spec.w1, spec.w2, spec.w3, spec.intermediate) == ("1", "w_in", "w_out", "w_up", 6)
    with pytest.raises(ConfigError, match="no MoE block was found"):
        autoep_model(ExpertParallelConfig(enabled=True), model)
    with pytest.raises(ValueError, match="does not divide the 4 experts"):
        autoep_model(cfg.model_copy(update={"autoep_size": 3}), model)


def test_grouped_matmul_equals_the_per_expert_loop() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 4, 8, generator=g).transpose(1, 2).requires_grad_()
    counts = [3, 0, 7]
    assert grouped_available(x, w)  # torch._grouped_mm runs here (else this would compare the loop with itself)
    fast = grouped_mm(x, w, counts)
    slow = torch.cat([x[:3] @ w[0], x[3:] @ w[2]])
    torch.testing.assert_close(fast, slow)
    gx, gw = torch.autograd.grad(fast.sum(), (x, w))
    hx, hw = torch.autograd.grad(grouped_mm(x, w, counts, use_grouped=False).sum(), (x, w))
    torch.testing.assert_close((gx, gw), (hx, hw))


def test_config_keys() -> None:
    cfg = load_config({"train_batch_size": 1, "expert_parallel": {"enabled": True, "autoep_size": 2,
                                                                 "preset_model": "mixtral"}})
    assert (cfg.expert_parallel.autoep_size, cfg.expert_parallel.use_grouped_mm) == (2, True)
    with pytest.raises(ConfigError, match="autoep_sise"):
        load_config({"train_batch_size": 1, "expert_parallel": {"autoep_sise": 2}})
    with pytest.raises(ConfigError, match="unknown preset_model"):
        load_config({"train_batch_size": 1, "expert_parallel": {"preset_model": "llama"}})
    cfg = load_config({"train_batch_size": 1, "expert_parallel": {"enabled": True, "score_func": "sigmoid",
                                                                 "num_expert_groups": 2, "num_limited_groups": 1}})
    assert (cfg.expert_parallel.score_func, cfg.expert_parallel.num_limited_groups) == ("sigmoid", 1)
    with pytest.raises(ConfigError, match="num_expert_groups"):
        load_config({"train_batch_size": 1, "expert_parallel": {"num_expert_groups": 0}})


def _hf_and_auto(family: str, model: dict | None = None, **section) -> tuple[nn.Module, nn.Module]:
    plain, auto = tiny_moe(family, **(model or {})), tiny_moe(family, **(model or {}))
    autoep_model(ExpertParallelConfig(enabled=True, **section), auto)
    return plain, auto


def _same_loss_and_grads(a: nn.Module, b: nn.Module) -> None:
    la, lb = loss_of(a, *batch(0, 0, 2)), loss_of(b, *batch(0, 0, 2))
    la.backward()
    lb.backward()
    torch.testing.assert_close(lb, la, rtol=1e-6, atol=0)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_top_k_and_route_norm_equal_the_hf_model_built_with_them() -> None:
    """top_k: HF's Mixtral with num_experts_per_tok=1 (its aux loss included); route_norm: Qwen2-MoE's norm_topk_prob."""
    from transformers import MixtralForCausalLM, Qwen2MoeForCausalLM

    plain, auto = _hf_and_auto("mixtral", top_k=1)
    assert auto.model.layers[0].mlp.gate.top_k == 1 and auto.num_experts_per_tok == 1
    cfg = plain.config
    cfg.num_experts_per_tok = 1
    one = MixtralForCausalLM(cfg).float()
    one.load_state_dict(plain.state_dict())
    _same_loss_and_grads(one, auto)
    plain, auto = _hf_and_auto("qwen2_moe", route_norm=True)
    cfg = plain.config
    cfg.norm_topk_prob = True
    normed = Qwen2MoeForCausalLM(cfg).float()
    normed.load_state_dict(plain.state_dict())
    _same_loss_and_grads(normed, auto)


def test_route_scale_and_score_apply_follow_deepspeeds_formulas() -> None:
    plain, auto = _hf_and_auto("mixtral", route_scale=2.0, routed_scaling_factor=3.0)  # the latter wins
    hf, ours = plain.model.layers[0].mlp.experts, auto.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(10, 16, generator=g), torch.rand(10, 2, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])
    torch.testing.assert_close(ours(h, idx, w), hf(h, idx, 3.0 * w), rtol=1e-6, atol=1e-7)   # top_scores * scale
    plain, auto = _hf_and_auto("mixtral", score_apply="pre")
    hf, ours = plain.model.layers[0].mlp.experts, auto.model.layers[0].mlp.experts
    want = sum(hf(h * w[:, j:j + 1], idx[:, j:j + 1], torch.ones(10, 1)) for j in range(2))  # experts(w x), summed
    torch.testing.assert_close(ours(h, idx, w), want, rtol=1e-5, atol=1e-6)


def test_routing_keys_the_model_cannot_honour_are_refused() -> None:
    with pytest.raises(NotSupportedYetError, match="normalises its top-k weights"):
        _hf_and_auto("mixtral", route_norm=False)
    _hf_and_auto("qwen2_moe", route_norm=False)  # its router does not normalise (norm_topk_prob false): honoured
    with pytest.raises(ConfigError, match="between 1 and the 4 experts"):
        _hf_and_auto("mixtral", top_k=5)
    with pytest.raises(ConfigError, match="top_k must be >= 1"):
        load_config({"train_batch_size": 1, "expert_parallel": {"enabled": True, "top_k": 0}})
    for key, value in (("combine_impl", "legacy_bmm"), ("load_balance_coeff", 0.001)):
        with pytest.raises(NotSupportedYetError, match=key):
            load_config({"train_batch_size": 1, "expert_parallel": {"enabled": True, key: value}})
    load_config({"train_batch_size": 1, "expert_parallel": {"enabled": True, "combine_impl": "weighted_sum"}})
    with pytest.raises(NotSupportedYetError, match="scores with softmax"):  # the kept router's own score function
        _hf_and_auto("mixtral", score_func="sigmoid")
    with pytest.raises(NotSupportedYetError, match="scores with sigmoid"):
        _hf_and_auto("deepseek_v3", score_func="softmax")
    _hf_and_auto("deepseek_v3", score_func="sigmoid")
    with pytest.raises(NotSupportedYetError, match="has no group limit"):
        _hf_and_auto("qwen2_moe", num_expert_groups=2)
    with pytest.raises(NotSupportedYetError, match="topk_method 'greedy'"):
        _hf_and_auto("deepseek_v2", num_limited_groups=1, model={"topk_method": "greedy"})
    with pytest.raises(ConfigError, match="3 does not divide the 4 experts"):
        _hf_and_auto("deepseek_v3", num_expert_groups=3)
    with pytest.raises(ConfigError, match="between 1 and the 2 expert groups"):
        _hf_and_auto("deepseek_v3", num_limited_groups=3)
    with pytest.raises(ConfigError, match="expert per group"):  # V3 scores a group by its top-2
        _hf_and_auto("deepseek_v3", num_expert_groups=4, num_limited_groups=2)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_blocks_are_found_and_keep_the_hf_loss(family: str) -> None:
    plain, auto = tiny_moe(family), tiny_moe(family)
    specs = autoep_model(ExpertParallelConfig(enabled=True, preset_model=family), auto)
    assert [s.name for s in specs] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert isinstance(auto.model.layers[0].mlp.experts, AutoEPExperts)
    _same_loss_and_grads(plain, auto)  # shared experts, group limit, scaling (and V3's bias) kept


def _deepspeed_route(logits, k, score, groups, limited, group_score, norm, scale, bias=None):
    """DeepSpeed master's TokenChoiceTopKRouter (deepspeed/moe/ep_router.py), written from its formula."""
    s = logits.float().sigmoid() if score == "sigmoid" else logits.float().softmax(-1)
    choice = s if bias is None else s + bias
    grouped = choice.view(len(s), groups, -1)
    g = grouped.max(-1).values if group_score == "max" else grouped.topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(limited, dim=-1)[1], True)
    idx = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(len(s), -1).topk(k, dim=-1)[1]
    w = s.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) if norm else w
    return idx, w * scale


def _sorted(idx, w):
    order = idx.argsort(-1)
    return idx.gather(1, order), w.gather(1, order)


@pytest.mark.parametrize("family,section,ds", [
    ("deepseek_v3", {}, ("sigmoid", 2, 1, "top2_sum", True, 1.5)),
    ("deepseek_v3", {"num_limited_groups": 2, "route_norm": False, "routed_scaling_factor": 2.5},
     ("sigmoid", 2, 2, "top2_sum", False, 2.5)),
    ("deepseek_v2", {}, ("softmax", 2, 1, "max", False, 1.5)),
    ("deepseek_v2", {"route_norm": True, "num_expert_groups": 4, "num_limited_groups": 2},
     ("softmax", 4, 2, "max", True, 1.5))])
def test_deepseek_routing_keys_are_deepspeeds_formula(family: str, section: dict, ds: tuple) -> None:
    """The kept HF router (plus AutoEP's adjustment) routes as DeepSpeed's router with its DeepSeek preset (V2:
    group score max, no norm; V3: sigmoid, score-correction bias, top-2-sum group score) and these keys."""
    model = tiny_moe(family)
    autoep_model(ExpertParallelConfig(enabled=True, **section), model)
    block = model.model.layers[1].mlp
    h = torch.randn(64, 16, generator=torch.Generator().manual_seed(3))
    logits, w, idx = block.gate(h)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    want_idx, want_w = _sorted(*_deepspeed_route(logits, 2, *ds, bias=bias))
    got_idx, got_w = _sorted(idx, block.experts.routing.weights(w))
    assert torch.equal(got_idx, want_idx)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    if ds[2] < ds[1] and 4 // ds[1] > 1:  # a real limit (one expert per group, scored by its max, is none)
        free_idx, _ = _sorted(*_deepspeed_route(logits, 2, ds[0], 1, 1, "max", False, 1.0, bias))
        assert not torch.equal(free_idx, want_idx)  # the group limit changed some choices


def test_deepseek_group_keys_equal_the_hf_model_built_with_them() -> None:
    """num_limited_groups 1 on a V3 built with topk_group 2 = HF's V3 built with topk_group 1 (loss, gradients)."""
    plain, auto = _hf_and_auto("deepseek_v3", model={"topk_group": 2}, num_limited_groups=1)
    limited = tiny_moe("deepseek_v3", topk_group=1)
    _same_loss_and_grads(limited, auto)
    with torch.no_grad():
        assert abs(float(loss_of(plain, *batch(0, 0, 2))) - float(loss_of(limited, *batch(0, 0, 2)))) > 1e-5
