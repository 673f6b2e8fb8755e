"""FP8 on a GPU with FP8 tensor cores (compute capability 8.9+): torch._scaled_mm against the emulation,
and a few bf16 training steps with FP8 linears against bf16 alone. Skipped elsewhere."""

import pytest
import torch
from torch import nn

from zerospeed.testing import run_distributed

CAPABLE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CAPABLE, reason="needs a CUDA device with FP8 (sm 8.9+)")]


def test_tensor_cores_compute_what_the_emulation_computes() -> None:
    from zerospeed.precision.fp8 import Float8Linear

    torch.manual_seed(0)
    emulated = nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)
    native = nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)
    native.load_state_dict(emulated.state_dict())
    for m, flag in ((emulated, False), (native, True)):
        m.__class__ = Float8Linear
        m.fp8_native = flag
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ys = [m(xi) for m, xi in zip((emulated, native), xs)]
    for y in ys:
        y.float().square().sum().backward()
    torch.testing.assert_close(ys[1], ys[0], rtol=1e-2, atol=1e-2)  # bf16 outputs, different summation order
    # bf16 gradients summed in another order: elements within two bf16 steps at the gradient's scale (on an H200,
    # |grad| up to 7.6 and the largest difference 0.03125, one step at 4-8), the whole within 1 % of its norm (0.23 %)
    g, ref = xs[1].grad.float(), xs[0].grad.float()
    step = 2.0 ** (torch.floor(torch.log2(ref.abs().max())) - 7)
    torch.testing.assert_close(g, ref, rtol=0.0, atol=2 * float(step))
    assert float((g - ref).norm() / ref.norm()) < 1e-2


def _losses(fp8: bool) -> list[float]:
    import zerospeed
    from zerospeed.models import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256), seed=0)
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
              "fp8": {"enabled": fp8}}  # backend auto: native on this GPU
    engine, *_ = zerospeed.initialize(model=model, config=config)
    assert bool(engine.fp8_modules) == fp8
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(20):
        b = torch.randint(0, 256, (8, 129), generator=g).cuda()
        _, loss = engine(b[:, :-1], b[:, 1:])
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    return out


def test_fp8_training_tracks_bf16_on_the_gpu() -> None:
    bf16 = run_distributed(_losses, 1, False, backend="nccl", timeout=300)[0]
    fp8 = run_distributed(_losses, 1, True, backend="nccl", timeout=300)[0]
    assert fp8 != bf16
    assert abs(sum(fp8[-5:]) - sum(bf16[-5:])) / sum(bf16[-5:]) < 0.03, (fp8, bf16)
