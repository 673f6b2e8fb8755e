"""Weight-only INT8 / INT4 quantization: round-trip error, packing, byte counts, perplexity vs fp32."""

import math

import pytest
import torch
import torch.nn.functional as F

import zerospeed
from zerospeed.data import ByteDataset
from zerospeed.inference.config import WeightQuantConfig
from zerospeed.inference.quantization import QuantizedLinear, dequantize, model_bytes, quantize, quantize_model
from zerospeed.models.gpt import GPT, GPTConfig


@pytest.mark.parametrize("bits,sym", [(8, True), (8, False), (4, True), (4, False)])
def test_round_trip_error_is_half_a_step(bits, sym):
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    codes, scale, offset = quantize(w, bits, sym, groups=4)
    assert codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert codes.shape == ((6, 64) if bits == 8 else (6, 32))  # INT4: two codes per byte
    assert scale.shape == (6, 4) and (offset is None) == sym
    back = dequantize(codes, scale, offset, bits, torch.float32)
    step = scale.float().repeat_interleave(16, dim=1)
    assert ((back - w).abs() <= step * 0.5 + 1e-3 * step + 1e-6).all()
    assert (back - w).abs().max() > 0  # really quantized


def test_groups_follow_columns():
    w = torch.cat([torch.full((2, 4), 0.01), torch.full((2, 4), 100.0)], dim=1)
    codes, scale, _ = quantize(w, 8, True, groups=2)
    assert torch.allclose(scale[:, 0], torch.tensor(0.01 / 127)) and torch.allclose(scale[:, 1], torch.tensor(100 / 127))
    with pytest.raises(ValueError, match="q_groups=3"):
        quantize(w, 8, True, groups=3)


def test_quantized_linear_matches_dequantized_weight_and_conv1d():
    transformers = pytest.importorskip("transformers")
    lin = torch.nn.Linear(16, 8)
    cfg = WeightQuantConfig(num_bits=4, q_type="asymmetric", q_groups=2)
    q = QuantizedLinear(lin.weight, lin.bias, cfg)
    x = torch.randn(3, 16)
    assert torch.allclose(q(x), F.linear(x, q.dequantized_weight(torch.float32), lin.bias))
    assert (q(x) - lin(x)).abs().max() < 0.1
    conv = transformers.pytorch_utils.Conv1D(8, 16)  # GPT-2's [in, out] linear
    torch.nn.init.normal_(conv.weight, std=0.2)
    holder = torch.nn.Sequential(conv)
    assert quantize_model(holder, WeightQuantConfig()) == 1 and isinstance(holder[0], QuantizedLinear)
    assert (holder(x) - conv(x)).abs().max() < 0.02


def _train(model, steps=120, bs=16):
    data = ByteDataset(model.config.block_size, "train")
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        idx = torch.randint(len(data), (bs,), generator=g).tolist()
        x, y = (torch.stack(t) for t in zip(*(data[i] for i in idx)))
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@torch.no_grad()
def _perplexity(model, windows=48):
    data = ByteDataset(model.config.block_size, "val")
    x, y = (torch.stack(t) for t in zip(*(data[i] for i in range(windows))))
    return math.exp(model(x, y)[1].item())


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    return _train(GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64), seed=0)).state_dict()


@pytest.mark.parametrize("bits,q_type,groups,max_ratio,max_ppl_rise", [
    (8, "symmetric", 1, 0.27, 0.01), (4, "asymmetric", 2, 0.15, 0.05)])
def test_bytes_and_perplexity(trained, bits, q_type, groups, max_ratio, max_ppl_rise):
    cfg = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)
    ref = GPT(cfg)
    ref.load_state_dict(trained)
    ppl_fp32 = _perplexity(ref.eval())
    assert ppl_fp32 < 64  # it learned something (uniform bytes would be 256)
    model = GPT(cfg)
    model.load_state_dict(trained)
    fp32_linear = model_bytes(model, linear_weights_only=True)
    eng = zerospeed.init_inference(model, dtype="fp32",
                                   quant={"weight": {"num_bits": bits, "q_type": q_type, "q_groups": groups}})
    assert sum(isinstance(m, QuantizedLinear) for m in eng.module.modules()) == 2 * 4 + 1  # every Linear + head
    ratio = model_bytes(eng.module, linear_weights_only=True) / fp32_linear
    assert ratio <= max_ratio, ratio
    ppl_q = _perplexity(eng.module)
    assert ppl_q != ppl_fp32
    print(f"int{bits}: linear-weight bytes {ratio:.4f}x fp32, perplexity {ppl_fp32:.3f} -> {ppl_q:.3f}")
    assert abs(ppl_q / ppl_fp32 - 1) <= max_ppl_rise, (ppl_fp32, ppl_q)


def test_int8_dtype_quantizes_and_generates():
    model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    eng = zerospeed.init_inference(model, dtype=torch.int8)
    assert isinstance(eng.module.blocks[0].attn.qkv, QuantizedLinear) and eng.module.blocks[0].attn.qkv.bits == 8
    out = eng.generate(ids, max_new_tokens=4)
    x = ids.clone()
    for _ in range(4):
        x = torch.cat([x, eng.module(x)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, x)  # cached decode of the quantized model equals its own full recompute


def test_int4_gpt2_cached_decode_equals_hf_generate_of_the_quantized_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  initializer_range=0.3, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    eng = zerospeed.init_inference(model, dtype="fp32", quant={"weight": {"num_bits": 4, "q_type": "asymmetric"}})
    assert isinstance(eng.module.transformer.h[0].attn.c_attn, QuantizedLinear)  # Conv1D converted
    ids = torch.tensor([[5, 17, 42, 8]])
    ref = eng.module.generate(ids, max_new_tokens=8, do_sample=False)  # HF's own loop over the quantized modules
    assert torch.equal(eng.generate(ids, max_new_tokens=8), ref)


@pytest.mark.parametrize("q", [{"num_bits": 8, "q_type": "symmetric", "q_groups": 1},
                               {"num_bits": 4, "q_type": "asymmetric", "q_groups": 2}], ids=["int8", "int4"])
def test_pytorch_int_kernels_equal_the_dequantized_path(q):
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(5, 3, 64)
    deq = QuantizedLinear(lin.weight, lin.bias, WeightQuantConfig(**q))
    ker = QuantizedLinear(lin.weight, lin.bias, WeightQuantConfig(**q, kernel="int"))
    assert ker.weight_nbytes() == deq.weight_nbytes()  # same codes, same bytes
    assert torch.allclose(ker.dequantized_weight(torch.float32), deq.dequantized_weight(torch.float32), atol=1e-6)
    assert torch.allclose(ker(x), deq(x), atol=1e-4) and (ker(x) - lin(x)).abs().max() > 0
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64), seed=0).eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    outs = [zerospeed.init_inference(GPT(model.config, seed=0).eval(), dtype="fp32",
                                     quant={"weight": {**q, "kernel": k}}).generate(ids, max_new_tokens=8)
            for k in ("dequant", "int")]
    assert torch.equal(*outs)


def test_int_kernel_layouts_it_cannot_run_are_refused():
    from zerospeed.config import NotSupportedYetError

    lin = torch.nn.Linear(64, 8)
    for q in ({"num_bits": 8, "q_type": "asymmetric"}, {"num_bits": 8, "q_groups": 2},
              {"num_bits": 4, "q_type": "symmetric", "q_groups": 2},
              {"num_bits": 4, "q_type": "asymmetric", "q_groups": 4}):  # 16 columns
        with pytest.raises(NotSupportedYetError, match="kernel 'int'"):
            QuantizedLinear(lin.weight, lin.bias, WeightQuantConfig(**q, kernel="int"))
