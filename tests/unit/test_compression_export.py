"""Issue 35 item 4: a QAT-trained linear exports to the inference engine's INT8/INT4 ``QuantizedLinear`` with the
training's own levels and scales (same forward, no new calibration); ``weight_quantization.post_init_quant``
quantizes matched linears with DeepSpeed's asymmetric group formula; tier 0."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from zerospeed.compression import init_compression
from zerospeed.compression.export import export_quantized
from zerospeed.compression.ptq import post_init_quantization
from zerospeed.compression.scheduler import CompressionScheduler
from zerospeed.config import ConfigError, load_config
from zerospeed.inference.quantization import QuantizedLinear


def _qat(qtype: str, bits: int, groups: int, in_forward: bool = True) -> dict[str, Any]:
    return {"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": in_forward, "quantization_type": qtype,
                              "quantize_groups": groups, "schedule_offset": 0},
        "different_groups": {"g": {"params": {"start_bits": bits, "target_bits": bits}, "modules": ["^0$"]}}}}}


@pytest.mark.parametrize("qtype,bits,groups,dtype", [("symmetric", 8, 4, torch.int8), ("asymmetric", 4, 32, torch.uint8),
                                                     ("symmetric", 6, 16, torch.int8), ("asymmetric", 3, 1, torch.uint8)])
def test_qat_linear_exports_with_its_own_levels_and_scales(qtype: str, bits: int, groups: int,
                                                           dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU())
    cfg = _qat(qtype, bits, groups)
    init_compression(model, cfg)
    CompressionScheduler(model, cfg["compression_training"]).step(step_zero_check=True)
    x = torch.randn(5, 32)
    with torch.no_grad():
        qat = model(x)
    w = model[0].weight.detach().clone()
    assert export_quantized(model) == ["0"]
    layer = model[0]
    assert isinstance(layer, QuantizedLinear) and layer.codes.dtype == dtype
    g = w.reshape(groups, -1)  # DeepSpeed's scale of the first group, in the engine's per-row table
    s0 = 2 * g[0].abs().max() / 2**bits if qtype == "symmetric" else (g[0].max() - g[0].min()) / 2**bits
    torch.testing.assert_close(layer.scale.reshape(-1)[0], s0)
    with torch.no_grad():
        torch.testing.assert_close(model(x), qat, rtol=1e-6, atol=1e-6)


def test_exported_gpt_serves_through_init_inference() -> None:
    from zerospeed.inference import init_inference
    from zerospeed.models.gpt import GPT, tiny

    g = GPT(tiny(), seed=0)
    cfg = {"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantize_groups": 32},
        "different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 4}, "modules": [r"blocks\."]}}}}}
    init_compression(g, cfg)
    CompressionScheduler(g, cfg["compression_training"]).step(step_zero_check=True)
    idx = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        qat = g(idx)[0]
    assert len(export_quantized(g)) == 8  # 2 blocks x (qkv, proj, fc, proj)
    engine = init_inference(g, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(engine(idx)[0], qat, rtol=1e-5, atol=1e-5)


def test_post_init_quant_uses_deepspeeds_asymmetric_groups() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(64, 8)), nn.Linear(8, 4))
    w = model[0][0].weight.detach().clone()
    section = load_config({"train_batch_size": 1, "weight_quantization": {
        "post_init_quant": {"0.0": {"num_bits": 8, "group_size": 32, "group_dim": 1, "symmetric": False}}}}
    ).weight_quantization
    assert post_init_quantization(model, section) == ["0.0"]
    assert isinstance(model[0][0], QuantizedLinear) and isinstance(model[1], nn.Linear)
    g = w.reshape(8, 2, 32)  # DeepSpeed: s = (2^b - 1) / (max - min), q = round(clamp((w - min) s, 0, 255))
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = 255 / (hi - lo)
    ref = (((g - lo) * s).clamp(0, 255).round() / s + lo).reshape(8, 64)
    torch.testing.assert_close(model[0][0].dequantized_weight(torch.float32), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="quantized_initialization.group_size"):  # required (tests/unit/test_quantized_init.py)
        load_config({"train_batch_size": 1, "weight_quantization": {"quantized_initialization": {"num_bits": 8}}})
    bad = load_config({"train_batch_size": 1, "weight_quantization": {"post_init_quant": {
        "1": {"num_bits": 8, "group_size": 3}}}}).weight_quantization
    with pytest.raises(ConfigError, match="group_size"):
        post_init_quantization(nn.Sequential(nn.Linear(8, 2), nn.Linear(8, 4)), bad)
