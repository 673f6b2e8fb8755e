"""FP8 linears (precision/fp8): scaling, the three FP8 matmuls, conversion and backend choice."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from zerospeed.comm import dequantize_fp8, quantize_fp8
from zerospeed.config.errors import ConfigError, NotSupportedYetError
from zerospeed.config.fp8 import Fp8Config
from zerospeed.precision.fp8 import (E4M3, E5M2, Float8Linear, convert_to_float8, fp8_candidates, from_fp8,
                                     reference_linear, resolve_backend, to_fp8)

CPU = torch.device("cpu")


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_dynamic_scale_maps_amax_to_the_format_max() -> None:
    x = _rand(64, 32) * 7
    for dtype, top in ((E4M3, 448.0), (E5M2, 57344.0)):
        codes, inv = to_fp8(x, dtype)
        assert codes.dtype == dtype and codes.float().abs().max().item() == top
        torch.testing.assert_close(inv, x.abs().max() / top)
        rel = ((from_fp8(codes, inv) - x).abs() / x.abs().clamp(min=x.abs().max() / 64)).max()
        assert rel <= (2 ** -4 if dtype == E4M3 else 2 ** -3) + 1e-6  # 3 / 2 mantissa bits: half an ulp
    codes, inv = to_fp8(torch.zeros(4, 4), E4M3)
    assert inv.item() == 1.0 and codes.float().abs().sum() == 0


def test_float8_linear_matmuls_are_fp8_products() -> None:
    layer = nn.Linear(32, 48)
    layer.__class__ = Float8Linear
    x = _rand(5, 3, 32, seed=1).requires_grad_()
    y = layer(x)
    torch.testing.assert_close(y, reference_linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    dy = _rand(5, 3, 48, seed=2)
    y.backward(dy)
    # written out: dy in e5m2, x and W in e4m3, products in fp32
    gq, g_inv = to_fp8(dy.reshape(-1, 48), E5M2)
    xq, x_inv = to_fp8(x.detach().reshape(-1, 32), E4M3)
    wq, w_inv = to_fp8(layer.weight.detach(), E4M3)
    g, xd, w = from_fp8(gq, g_inv), from_fp8(xq, x_inv), from_fp8(wq, w_inv)
    torch.testing.assert_close(x.grad, (g @ w).reshape(5, 3, 32), rtol=0, atol=0)
    torch.testing.assert_close(layer.weight.grad, g.t() @ xd, rtol=0, atol=0)
    torch.testing.assert_close(layer.bias.grad, dy.sum((0, 1)))
    # FP8 is lossy: close to the fp32 layer, not equal to it
    exact = torch.nn.functional.linear(x.detach(), layer.weight, layer.bias)
    err = (y.detach() - exact).abs().max() / exact.abs().max()
    assert 0 < err < 0.1


def test_native_scaled_mm_equals_the_emulation() -> None:
    """torch._scaled_mm (PyTorch's CPU kernel here; the GPU's tensor cores under CUDA) computes what the
    emulation computes: the FP8 codes' products, summed in fp32."""
    emulated, native = nn.Linear(64, 32), nn.Linear(64, 32)
    native.load_state_dict(emulated.state_dict())
    for m, flag in ((emulated, False), (native, True)):
        m.__class__ = Float8Linear
        m.fp8_native = flag
    x = _rand(13, 64, seed=3)  # 13 tokens: dW's inner size padded to 16
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ys = [m(xi) for m, xi in zip((emulated, native), xs)]
    for y in ys:
        y.square().sum().backward()
    torch.testing.assert_close(ys[1], ys[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(native.weight.grad, emulated.weight.grad, rtol=1e-6, atol=1e-6)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(32, 40)  # 40 is not a multiple of 16
        self.small = nn.Linear(16, 16)
        self.lm_head = nn.Linear(64, 32)


def test_conversion_picks_eligible_linears_and_keeps_parameters() -> None:
    net = _Net()
    weight = net.up.weight
    assert fp8_candidates(net, Fp8Config(min_features=32)) == ["up"]
    names = convert_to_float8(net, Fp8Config(backend="emulated"), CPU)
    assert names == ["up", "small"] and type(net.up) is Float8Linear and net.up.weight is weight
    assert type(net.odd) is nn.Linear and type(net.lm_head) is nn.Linear
    with pytest.raises(ConfigError, match="no nn.Linear to convert"):
        convert_to_float8(nn.Sequential(nn.Linear(3, 5)), Fp8Config(backend="emulated"), CPU)


def test_backend_choice_and_its_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="FP8 tensor cores.*emulated"):
        resolve_backend(Fp8Config(), CPU)  # auto needs a GPU with FP8
    assert resolve_backend(Fp8Config(backend="emulated"), CPU) == "emulated"
    assert resolve_backend(Fp8Config(backend="native"), CPU) == "native"
    with pytest.raises(NotSupportedYetError, match="Transformer Engine"):
        resolve_backend(Fp8Config(backend="transformer_engine"), CPU)
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match="needs torchao"):
        resolve_backend(Fp8Config(backend="torchao"), CPU)


def test_fp8_weight_gather_codec_blocks() -> None:
    x = _rand(64, seed=4)
    x[:32] *= 100.0
    q, s = quantize_fp8(x, 2)
    assert q.dtype == torch.uint8 and s.shape == (2,)
    torch.testing.assert_close(s, torch.stack([x[:32].abs().max(), x[32:].abs().max()]) / 448)
    back = dequantize_fp8(q, s, torch.float32)
    blocks = x.view(2, -1)
    rel = (back.view(2, -1) - blocks).abs() / blocks.abs().clamp(min=s.view(2, 1) * 448 / 64)
    assert rel.max() <= 2 ** -4 + 1e-6


def test_fp8_training_tracks_fp32() -> None:
    """The tiny GPT on the bundled corpus: 40 steps of FP8 (emulated) land within 3 % of fp32's loss."""
    from zerospeed.data import load_corpus
    from zerospeed.models import GPT, tiny

    data = torch.tensor(list(load_corpus()[:20000]), dtype=torch.long)
    finals = []
    for fp8 in (False, True):
        model = GPT(tiny(), seed=0)
        if fp8:
            assert convert_to_float8(model, Fp8Config(backend="emulated"), CPU)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(40):
            idx = torch.randint(0, data.numel() - 33, (8,), generator=g)
            x = torch.stack([data[i:i + 33] for i in idx.tolist()])
            _, loss = model(x[:, :-1], x[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        finals.append(sum(losses[-5:]) / 5)
    assert finals[1] != finals[0]
    assert abs(finals[1] - finals[0]) / finals[0] < 0.03, finals


def test_torchao_backend_computes_the_same_numbers() -> None:
    """torchao's Float8Linear (an independent implementation of the same recipe) gives the same outputs and
    gradients up to fp32 rounding (the FP8 codes agree; bias and scale arithmetic differ in the last bit).
    Skipped where torchao is not installed (it is not in the test extra)."""
    pytest.importorskip("torchao.float8")
    ours, theirs = nn.Sequential(nn.Linear(64, 32)), nn.Sequential(nn.Linear(64, 32))
    theirs.load_state_dict(ours.state_dict())
    convert_to_float8(ours, Fp8Config(backend="native", skip_modules=[]), CPU)  # both call torch._scaled_mm
    convert_to_float8(theirs, Fp8Config(backend="torchao", skip_modules=[]), CPU)
    assert type(theirs[0]).__module__.startswith("torchao")
    xs = [_rand(16, 64, seed=5).requires_grad_() for _ in range(2)]
    ys = [m(x) for m, x in zip((ours, theirs), xs)]
    for y in ys:
        y.square().sum().backward()
    for a, b in ((ys[0], ys[1]), (xs[0].grad, xs[1].grad), (ours[0].weight.grad, theirs[0].weight.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
