"""Muon's pieces without processes: Newton-Schulz, the update rule, the Muon/Adam split, owner assignment, config."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from zerospeed.config.errors import ConfigError, NotSupportedYetError
from zerospeed.optim import build_optimizer
from zerospeed.optim.muon import Muon, MuonWithAuxAdam
from zerospeed.optim.muon_groups import split_muon_groups, tag_use_muon, wants_muon
from zerospeed.optim.newton_schulz import COEFFICIENTS, gram_newton_schulz, newton_schulz, orthogonalize
from zerospeed.zero.muon_exchange import assign_owners


def _scalar_map(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """U f(S) V^T with f the quintic iterated on each normalised singular value: what NS must compute."""
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    s = s / (g.norm() + 1e-7)
    a, b, c = COEFFICIENTS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag(s) @ vh


@pytest.mark.parametrize("shape", [(6, 15), (15, 6), (9, 9)])
@pytest.mark.parametrize("fn", [newton_schulz, gram_newton_schulz])
def test_newton_schulz_is_the_singular_value_map(shape: tuple[int, int], fn) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(fn(g, dtype=torch.float64), _scalar_map(g), rtol=1e-10, atol=1e-12)


def test_newton_schulz_nearly_orthogonalises() -> None:
    g = torch.randn(16, 40, generator=torch.Generator().manual_seed(2))
    s = torch.linalg.svdvals(newton_schulz(g))
    assert 0.6 < float(s.min()) and float(s.max()) < 1.2  # Keller Jordan's S' ~ [0.7, 1.2], not exactly 1
    assert newton_schulz(g).dtype == torch.float32  # fp32 on the CPU


def test_orthogonalize_scale_and_conv_filters() -> None:
    tall = torch.randn(12, 3, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(orthogonalize(tall, "standard"), newton_schulz(tall) * math.sqrt(12 / 3))
    conv = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(4))
    out = orthogonalize(conv, "gram")
    assert out.shape == conv.shape  # viewed as [4, 18]; scale from the last two dims (3x3: 1), as DeepSpeed
    torch.testing.assert_close(out, gram_newton_schulz(conv.reshape(4, 18)).reshape(conv.shape))
    with pytest.raises(ValueError, match="ndim >= 2"):
        orthogonalize(torch.ones(5))
    with pytest.raises(ValueError, match="ns_method"):
        orthogonalize(tall, "svd")


def test_muon_step_is_deepspeeds_formula() -> None:
    """m = lerp(m, g, 1-b); u = lerp(g, m, b); W = W (1 - lr wd) - lr NS(u) sqrt(max(1, r/c)), two steps."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 5))
    lr, wd, beta = 0.05, 0.1, 0.9
    opt = Muon([w], lr=lr, weight_decay=wd, momentum=beta, ns_method="standard")
    expect, m = w.detach().clone(), torch.zeros(8, 5)
    for _ in range(2):
        g = torch.randn(8, 5)
        w.grad = g.clone()
        opt.step()
        m = m + (1 - beta) * (g - m)
        u = g + beta * (m - g)
        expect = expect * (1 - lr * wd) - lr * newton_schulz(u) * math.sqrt(8 / 5)
    torch.testing.assert_close(w.detach(), expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], m)


def test_muon_keeps_momentum_on_overflow_and_rejects_vectors() -> None:
    w = nn.Parameter(torch.ones(3, 4))
    opt = Muon([w])
    w.grad = torch.ones(3, 4)
    opt.step()
    before = opt.state[w]["momentum_buffer"].clone()
    w.grad = torch.full((3, 4), float("inf"))
    opt.step()
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], before)
    b = nn.Parameter(torch.ones(4))
    b.grad = torch.ones(4)
    with pytest.raises(ValueError, match="use_muon = False"):
        Muon([b]).step()


def test_aux_adam_is_deepspeeds_with_its_defaults() -> None:
    w = nn.Parameter(torch.ones(3))
    opt = MuonWithAuxAdam([{"params": [w], "use_muon": False, "weight_decay": 0.1}])
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"]) == (3e-4, (0.9, 0.95), 1e-10)
    w.grad = torch.full((3,), 0.5)
    opt.step()
    # first step: m_hat = g, v_hat = g^2 -> update g / (|g| + eps) = 1; decoupled decay first
    torch.testing.assert_close(w.detach(), torch.full((3,), (1 - 3e-4 * 0.1) - 3e-4 * 0.5 / (0.5 + 1e-10)))
    with pytest.raises(ValueError, match="use_muon"):
        MuonWithAuxAdam([{"params": [w]}])


def test_state_dict_round_trip_is_torchs() -> None:
    def make() -> tuple[nn.Module, MuonWithAuxAdam]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        tag_use_muon(model)
        return model, MuonWithAuxAdam(split_muon_groups([{"params": list(model.parameters())}], {}))

    def step(model: nn.Module, opt: MuonWithAuxAdam, seed: int) -> None:
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    a, oa = make()
    step(a, oa, 0)
    sd = copy.deepcopy(oa.state_dict())  # a snapshot: torch's state_dict shares the live tensors
    assert set(sd["state"][0]) == {"momentum_buffer"} and set(sd["state"][2]) == {"step", "exp_avg", "exp_avg_sq"}
    b, ob = make()
    b.load_state_dict(a.state_dict())
    ob.load_state_dict(sd)
    step(a, oa, 1)
    step(b, ob, 1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_grouping_rule_is_deepspeeds() -> None:
    assert wants_muon("blocks.0.attn.qkv.weight", (12, 4))
    assert not wants_muon("blocks.0.attn.qkv.bias", (12,))
    assert not wants_muon("model.embed_tokens.weight", (50, 4))
    assert not wants_muon("wpe_Embedding", (50, 4))  # case-insensitive, as DeepSpeed
    assert not wants_muon("lm_head.weight", (50, 4))
    assert wants_muon("conv.weight", (4, 2, 3, 3))

    model = nn.ModuleDict({"embed": nn.Embedding(5, 4), "fc": nn.Linear(4, 4), "out": nn.Linear(4, 5)})
    model["out"].weight.use_muon = False  # a user's own choice is kept
    model["fc"].bias.requires_grad_(False)
    tag_use_muon(model)
    groups = split_muon_groups(
        [{"params": [model["embed"].weight, model["fc"].weight, model["fc"].bias], "weight_decay": 0.0},
         {"params": list(model["out"].parameters()), "lr": 1e-3, "name": "head"}],
        {"lr": 0.01, "adam_lr": 1e-4, "weight_decay": 0.1, "momentum": 0.9, "betas": [0.8, 0.9]})
    brief = [(g["name"], g["use_muon"], len(g["params"]), g["lr"], g["weight_decay"]) for g in groups]
    assert brief == [("group0-muon-params", True, 1, 0.01, 0.0), ("group0-adam-params", False, 1, 1e-4, 0.0),
                     ("head-adam-params", False, 2, 1e-3, 0.1)]  # frozen bias left out; group keys win
    assert groups[0]["momentum"] == 0.9 and "betas" not in groups[0] and groups[1]["betas"] == (0.8, 0.9)
    with pytest.raises(ValueError, match="tagged with use_muon"):
        split_muon_groups([{"params": [nn.Parameter(torch.ones(2, 2))]}], {})


def test_assign_owners_balances_largest_first() -> None:
    assert assign_owners([10, 40, 30, 20], 2) == [0, 0, 1, 1]  # 40 -> 0, 30 -> 1, 20 -> 1 (30 < 40), 10 -> 0
    assert assign_owners([5, 5, 5], 1) == [0, 0, 0]
    owners = assign_owners([7] * 5, 3)
    assert sorted(owners.count(r) for r in range(3)) == [1, 2, 2]


def test_config_builds_and_names_bad_keys() -> None:
    w, b = nn.Parameter(torch.ones(3, 3)), nn.Parameter(torch.ones(3))
    opt = build_optimizer("muon", {"lr": 0.01, "adam_w_mode": False},
                          [{"params": [w], "use_muon": True, "lr": 0.01}, {"params": [b], "use_muon": False}])
    assert isinstance(opt, MuonWithAuxAdam) and not opt.adam_w_mode
    with pytest.raises(ConfigError, match="use_muon"):
        build_optimizer("Muon", {}, [{"params": [w]}])
    with pytest.raises(ConfigError, match="optimizer.params.nesterov"):
        build_optimizer("Muon", {"nesterov": True}, [{"params": [w], "use_muon": True}])
    with pytest.raises(ConfigError, match="ns_method"):
        build_optimizer("Muon", {"ns_method": "svd"}, [{"params": [w], "use_muon": True}])
    with pytest.raises(NotSupportedYetError, match="per_head_muon"):
        build_optimizer("Muon", {"per_head_muon": True}, [{"params": [w], "use_muon": True}])


def test_zero_checks_accept_muon_and_refuse_nvme() -> None:
    from zerospeed.config import load_config
    from zerospeed.runtime.build_optimizer import check_zero_optimizer as _check_zero_optimizer

    opt = MuonWithAuxAdam([{"params": [nn.Parameter(torch.ones(2, 2))], "use_muon": True}])
    _check_zero_optimizer(load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}), opt)
    nvme = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})
    with pytest.raises(NotSupportedYetError, match="NVMe"):
        _check_zero_optimizer(nvme, opt)
