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
from zerospeed.parallel.expert.auto.grouped import grouped_mm

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
    a, b = loss_of(plain, *batch(0, 0, 2)), loss_of(auto, *batch(0, 0, 2))
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
    for (n, p), (_, q) in zip(plain.named_parameters(), auto.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


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
    with pytest.raises(NotSupportedYetError, match="score_func"):  # AutoEP keeps the HF router's own routing
        load_config({"train_batch_size": 1, "expert_parallel": {"enabled": True, "score_func": "sigmoid"}})
