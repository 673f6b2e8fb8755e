"""Muon on CUDA (skipped without a device): DeepSpeed's half-precision Newton-Schulz, and ZeRO training on NCCL."""

import pytest
import torch

from zerospeed.testing import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize(("method", "dtype"), [("gram", torch.float16), ("standard", torch.bfloat16)])
def test_newton_schulz_half_precision_on_cuda(method: str, dtype: torch.dtype) -> None:
    from zerospeed.optim.newton_schulz import compute_dtype, orthogonalize

    assert compute_dtype(method, torch.device("cuda")) == dtype
    g = torch.randn(64, 160, generator=torch.Generator().manual_seed(0))
    cpu = orthogonalize(g, method)  # fp32
    cuda = orthogonalize(g.cuda(), method).cpu()
    assert cuda.dtype == torch.float32
    torch.testing.assert_close(cuda, cpu, rtol=0, atol=3e-2)  # the half-precision iteration, as DeepSpeed's


def _world() -> int:
    return 2 if torch.cuda.device_count() >= 2 else 1


def _train(stage: int) -> list[float]:
    from ..dist.test_muon_parity import STEPS, build, train

    engine = build(stage)
    return train(engine, 0, STEPS)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_muon_trains_under_zero_on_cuda(stage: int) -> None:
    from ..dist.test_muon_parity import reference

    ref, _ = reference()
    for losses in run_distributed(_train, _world(), stage, backend="nccl", timeout=300):
        # fp16 Gram Newton-Schulz on the device: close to the fp32 CPU reference, not equal
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=2e-2, atol=1e-3)
