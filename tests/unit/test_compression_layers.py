"""DeepSpeed 0.19.6's compression library (issue 35): each technique's forward equals a hand-written reference of
DeepSpeed's formula on small layers, switched on at its ``schedule_offset``; tier 0."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.compression import init_compression
from zerospeed.compression.scheduler import CompressionScheduler
from zerospeed.config import ConfigError


# --- hand-written references of DeepSpeed 0.19.6's formulas (compression/utils.py, basic_layer.py) ----------
def ref_sym(x: torch.Tensor, bits: int, groups: int) -> torch.Tensor:
    g = x.reshape(groups, -1)
    scale = 2 * g.abs().amax(dim=1, keepdim=True) / 2**bits
    return ((g / scale).round().clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * scale).reshape(x.shape)


def ref_asym(x: torch.Tensor, bits: int, groups: int) -> torch.Tensor:
    g = x.reshape(groups, -1)
    lo, hi = g.amin(dim=1, keepdim=True), g.amax(dim=1, keepdim=True)
    scale = (hi - lo) / 2**bits
    zp = (lo / scale).round() * scale
    return (((g - zp) / scale).round().clamp(0, 2**bits - 1) * scale + zp).reshape(x.shape)


def ref_ternary(x: torch.Tensor, groups: int) -> torch.Tensor:
    g = x.reshape(groups, -1)
    t = 0.7 * g.abs().sum(1, keepdim=True) / g.shape[1]
    keep = (g.abs() > t).float()
    alpha = (keep * g.abs()).sum(1, keepdim=True) / keep.sum(1, keepdim=True)
    return (alpha * (g > t).float() - alpha * (g < -t).float()).reshape(x.shape)


def ref_topk(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    k = math.ceil(ratio * scores.numel())
    flat = torch.zeros(scores.numel())
    flat[scores.flatten().argsort(descending=True)[:k]] = 1.0
    return flat.reshape(scores.shape)


def section(technique: str, shared: dict[str, Any], params: dict[str, Any], modules: list[str] | None = None,
            related: list[list[str]] | None = None) -> dict[str, Any]:
    group: dict[str, Any] = {"params": params, "modules": modules or ["*"]}
    if related is not None:
        group["related_modules"] = related
    return {"compression_training": {technique: {"shared_parameters": {"enabled": True, "schedule_offset": 0, **shared},
                                                  "different_groups": {"g1": group}}}}


def compressed(model: nn.Module, cfg: dict[str, Any]) -> nn.Module:
    init_compression(model, cfg)
    CompressionScheduler(model, cfg["compression_training"]).step(step_zero_check=True)
    return model


def linear(i: int = 8, o: int = 6, bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(i, o, bias=bias))


@pytest.mark.parametrize("qtype,bits,groups", [("symmetric", 8, 1), ("symmetric", 4, 3), ("asymmetric", 8, 2),
                                               ("asymmetric", 4, 6), ("symmetric", 2, 2)])
def test_weight_quantization_in_forward_matches_formula(qtype: str, bits: int, groups: int) -> None:
    m = linear()
    w, b = m[0].weight.detach().clone(), m[0].bias.detach().clone()
    compressed(m, section("weight_quantization", {"quantize_weight_in_forward": True, "quantization_type": qtype,
                                                  "quantize_groups": groups},
                          {"start_bits": bits, "target_bits": bits}))
    x = torch.randn(5, 8)
    ref = {"symmetric": ref_sym, "asymmetric": ref_asym}[qtype] if bits > 2 else (lambda t, _b, g: ref_ternary(t, g))
    torch.testing.assert_close(m(x), F.linear(x, ref(w, bits, groups), b))
    m(x).sum().backward()  # straight-through: the gradient reaches the float weight
    torch.testing.assert_close(m[0].weight.grad, torch.ones(5, 6).t() @ x)


def test_schedule_offset_switches_technique_on_at_its_step() -> None:
    m = linear()
    w = m[0].weight.detach().clone()
    cfg = section("weight_quantization", {"quantize_weight_in_forward": True, "schedule_offset": 2},
                  {"start_bits": 4, "target_bits": 4})
    init_compression(m, cfg)
    sched = CompressionScheduler(m, cfg["compression_training"])
    x = torch.randn(3, 8)
    sched.step(step_zero_check=True)
    sched.step()
    torch.testing.assert_close(m(x), F.linear(x, w, m[0].bias))  # step 1 < offset 2: off
    sched.step()
    torch.testing.assert_close(m(x), F.linear(x, ref_sym(w, 4, 1), m[0].bias))
    assert sched.weight_quantization_enabled and sched.switched_on == {"weight_quantization": 2}


def test_activation_quantization_dynamic_per_token_and_static_running_range() -> None:
    m = linear()
    compressed(m, section("activation_quantization", {"quantization_type": "asymmetric"}, {"bits": 8}))
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(m(x), m[0].__class__.__mro__[-3].forward(m[0], ref_asym(x, 8, 6)))  # 6 tokens
    s = linear()
    compressed(s, section("activation_quantization", {"range_calibration": "static"}, {"bits": 4}))
    x1, x2 = torch.randn(4, 8), 3 * torch.randn(4, 8)
    s(x1)
    y = s(x2)
    lo = x1.min() * 0.95 + x1.min() * 0.05
    lo, hi = lo * 0.95 + x2.min() * 0.05, (x1.max() * 0.95 + x1.max() * 0.05) * 0.95 + x2.max() * 0.05
    top = torch.max(lo.abs(), hi)
    scale = 2 * top / 16
    xq = (x2 / scale).round().clamp(-8, 7) * scale
    torch.testing.assert_close(y, F.linear(xq, s[0].weight, s[0].bias))


def test_sparse_pruning_l1_and_learned_topk() -> None:
    m = linear()
    w = m[0].weight.detach().clone()
    compressed(m, section("sparse_pruning", {"method": "l1"}, {"dense_ratio": 0.25}))
    x = torch.randn(3, 8)
    torch.testing.assert_close(m(x), F.linear(x, w * ref_topk(w.abs(), 0.25), m[0].bias))
    t = linear()
    compressed(t, section("sparse_pruning", {"method": "topk"}, {"dense_ratio": 0.5}))
    scores = t[0].sparse_mask_scores
    torch.testing.assert_close(t(x), F.linear(x, w * ref_topk(scores.detach(), 0.5), t[0].bias))
    t(x).sum().backward()
    assert scores.grad is not None and scores.grad.abs().sum() > 0  # the scores learn (straight through)


def test_row_and_head_pruning_masks() -> None:
    m = linear()
    w, b = m[0].weight.detach().clone(), m[0].bias.detach().clone()
    compressed(m, section("row_pruning", {"method": "l1"}, {"dense_ratio": 0.5}))
    keep = ref_topk(w.abs().sum(1), 0.5)
    x = torch.randn(3, 8)
    torch.testing.assert_close(m(x), F.linear(x, w * keep[:, None], b * keep))
    h = linear()
    compressed(h, section("head_pruning", {"num_heads": 4}, {"dense_ratio": 0.5}))
    heads = ref_topk(h[0].head_pruning_scores.detach(), 0.5).reshape(4)
    cols = heads.repeat_interleave(2)  # 8 input columns, 2 per head
    torch.testing.assert_close(h(x), F.linear(x, w * cols[None, :], b))


def test_channel_pruning_conv() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1))
    w, b = m[0].weight.detach().clone(), m[0].bias.detach().clone()
    compressed(m, section("channel_pruning", {"method": "l1"}, {"dense_ratio": 0.5}))
    keep = ref_topk(w.abs().sum((1, 2, 3)), 0.5)
    x = torch.randn(2, 3, 5, 5)
    torch.testing.assert_close(m(x), F.conv2d(x, w * keep[:, None, None, None], b * keep, padding=1))


def test_swap_keeps_tied_parameters_and_config_errors() -> None:
    from zerospeed.models.gpt import GPT, tiny

    g = GPT(tiny(), seed=0)
    n = sum(p.numel() for p in g.parameters())
    init_compression(g, section("weight_quantization", {"quantize_weight_in_forward": True},
                                {"start_bits": 8, "target_bits": 8}))
    assert g.lm_head.weight is g.wte.weight and sum(p.numel() for p in g.parameters()) == n
    with pytest.raises(ConfigError, match="different_groups must be specified"):
        init_compression(linear(), {"compression_training": {"row_pruning": {"shared_parameters": {"enabled": True}}}})
    with pytest.raises(ConfigError, match="Did you mean 'method'"):
        init_compression(linear(), section("row_pruning", {"methd": "l1"}, {"dense_ratio": 0.5}))
    with pytest.raises(ConfigError, match="num_heads must be specified"):
        init_compression(linear(), section("head_pruning", {"num_heads": None}, {"dense_ratio": 0.5}))
    with pytest.raises(ConfigError, match="snip_momentum"):
        init_compression(linear(), section("sparse_pruning", {"method": "snip_momentum"}, {"dense_ratio": 0.5}))
    two = {"compression_training": {"row_pruning": {"shared_parameters": {"enabled": True}, "different_groups": {
        "a": {"params": {"dense_ratio": 0.5}, "modules": ["0"]}, "b": {"params": {"dense_ratio": 0.5}}}}}}
    with pytest.raises(ConfigError, match="already in another group"):
        init_compression(linear(), two)


def test_fp32_mask_and_range_buffers_follow_a_bf16_model() -> None:
    m = linear()
    cfg = section("row_pruning", {"method": "l1"}, {"dense_ratio": 0.5})
    cfg["compression_training"]["activation_quantization"] = {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "static"},
        "different_groups": {"a": {"params": {"bits": 8}}}}
    compressed(m, cfg)
    for p in m.parameters():  # what place_model does: parameters cast, buffers keep fp32 (no buffer_dtype)
        p.data = p.data.to(torch.bfloat16)
    assert m[0].row_pruning_mask.dtype == torch.float32
    assert m(torch.randn(3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
