"""``weight_quantization.quantized_initialization`` without processes: DeepSpeed 0.19.6's group formula, the packed
partition's bytes, the config, and the path without ``zero.Init`` (the engine's quantized layers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.compression.ptq import initialization_quantization
from zerospeed.config import ConfigError, load_config
from zerospeed.config.errors import NotSupportedYetError
from zerospeed.inference.group_quant import GroupSpec, QuantizedEmbedding, dequantize_groups, quantize_groups
from zerospeed.inference.quantization import QuantizedLinear
from zerospeed.zero.stage3.quantized_shard import WeightCodec


def deepspeed_dequantized(w: torch.Tensor, bits: int, group_size: int, group_dim: int) -> torch.Tensor:
    """DeepSpeed 0.19.6's Quantizer + DeQuantizer (inference/quantization/utils.py), written out by hand."""
    shape = w.shape
    g = w.reshape(shape[:group_dim] + (shape[group_dim] // group_size, group_size) + shape[group_dim + 1:])
    lo, hi = g.amin(group_dim + 1, keepdim=True), g.amax(group_dim + 1, keepdim=True)
    scale = (2 ** bits - 1) / (hi - lo)
    q = ((g - lo) * scale).clamp(0, 2 ** bits - 1).round()
    return (q / scale + lo).reshape(shape)


@pytest.mark.parametrize("bits,group_dim", [(8, 1), (4, 1), (4, 0)])
def test_groups_follow_deepspeeds_formula(bits: int, group_dim: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(12, 16)
    spec = GroupSpec(bits, 4, group_dim)
    got = dequantize_groups(quantize_groups(w, spec), w.shape, group_dim, torch.float32)
    torch.testing.assert_close(got, deepspeed_dequantized(w, bits, 4, group_dim), rtol=1e-6, atol=1e-6)
    assert (got - w).abs().max() > 1e-4  # really quantized
    w[0, :4] = 0.5  # a constant group comes back exactly (DeepSpeed computes 0 * inf there)
    flat = dequantize_groups(quantize_groups(w, GroupSpec(bits, 4, 1)), w.shape, 1, torch.float32)
    assert torch.equal(flat[0, :4], w[0, :4])


def test_packed_partition_bytes_are_codes_plus_scales() -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 32)
    for bits, codes in ((8, 24 * 32), (4, 24 * 32 // 2)):
        codec = WeightCodec(GroupSpec(bits, 8, 1), w.shape, torch.float32)
        packed = codec.encode(w)
        groups = 24 * 32 // 8
        assert codec.nbytes == packed.numel() == codes + 2 * 4 * groups and packed.dtype == torch.uint8
        out = torch.empty(w.numel())
        codec.decode(packed, out)
        torch.testing.assert_close(out.view_as(w), deepspeed_dequantized(w, bits, 8, 1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="group_size 5 does not divide"):
        WeightCodec(GroupSpec(8, 5, 1), w.shape, torch.float32)


def test_config_accepts_the_key_and_names_bad_values() -> None:
    base = {"train_batch_size": 1}
    section = {"num_bits": 4, "group_size": 32, "group_dim": 1, "symmetric": False}  # DeepSpeed's test config
    spec = load_config({**base, "weight_quantization": {"quantized_initialization": section}}
                       ).weight_quantization.initialization_spec()
    assert spec == GroupSpec(4, 32, 1)
    assert load_config({**base, "weight_quantization": {"quantized_initialization": {}}}
                       ).weight_quantization.initialization_spec() is None
    with pytest.raises(ConfigError, match="asymmetric"):
        load_config({**base, "weight_quantization": {"quantized_initialization": {**section, "symmetric": True}}})
    with pytest.raises(ConfigError, match="num_bits"):
        load_config({**base, "weight_quantization": {"quantized_initialization": {**section, "num_bits": 3}}})


def test_without_zero_init_layers_become_the_engines_quantized_ones() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    weights = [model[i].weight.detach().clone() for i in (0, 1, 3)]
    ids = torch.randint(0, 10, (2, 5))
    spec = GroupSpec(4, 8, 1)
    assert initialization_quantization(model, spec) == ["0", "1", "3"]
    assert isinstance(model[0], QuantizedEmbedding) and isinstance(model[1], QuantizedLinear)
    assert model[1].bias.requires_grad  # the module's own bias, still trained
    ref = nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    ref.load_state_dict({**{k: v for k, v in model.state_dict().items() if k.endswith("bias")},
                         "0.weight": deepspeed_dequantized(weights[0], 4, 8, 1),
                         "1.weight": deepspeed_dequantized(weights[1], 4, 8, 1),
                         "3.weight": deepspeed_dequantized(weights[2], 4, 8, 1)})
    torch.testing.assert_close(model(ids), ref(ids), rtol=1e-5, atol=1e-6)
    assert model[1].weight_nbytes() == 8 * 16 // 2 + 2 * 4 * 8 * 2
    with pytest.raises(NotSupportedYetError, match="group_dim 0"):
        initialization_quantization(nn.Sequential(nn.Linear(8, 8)), GroupSpec(8, 4, 0))
    with pytest.raises(ConfigError, match="group_size 3 does not divide"):
        initialization_quantization(nn.Sequential(nn.Linear(8, 8)), GroupSpec(8, 3, 1))


def test_refused_with_tensor_parallelism() -> None:
    from zerospeed.compression.runtime import compression_runtime

    cfg = load_config({"train_batch_size": 1, "tensor_parallel": {"autotp_size": 2},
                       "weight_quantization": {"quantized_initialization": {"group_size": 8}}})
    with pytest.raises(NotSupportedYetError, match="tensor parallelism"):
        compression_runtime(cfg, nn.Sequential(nn.Linear(8, 8)))
