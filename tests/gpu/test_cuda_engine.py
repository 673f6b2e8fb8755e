"""The parity tests on CUDA/NCCL (skipped without a device). One rank per GPU; world 1 on a single GPU."""

import pytest
import torch

from zerospeed.testing import run_distributed

from ..dist.parity import engine_losses, reference_losses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS, MB, GAS, CLIP = 10, 2, 2, 0.5


def _world() -> int:
    return 2 if torch.cuda.device_count() >= 2 else 1


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp32_parity_cuda(stage: int) -> None:
    world = _world()
    ref, _ = reference_losses(STEPS, MB, GAS * 2 // world, world, CLIP)
    results = run_distributed(engine_losses, world, stage, STEPS, MB, GAS * 2 // world, CLIP, backend="nccl",
                              timeout=300)
    for losses, _ in results:
        # TF32 may be on for matmuls on the device: a looser tolerance than CPU's 1e-5.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_cuda(precision: str) -> None:
    world = _world()
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {"fp16": {"enabled": True, "initial_scale_power": 8}}
    ref, _ = reference_losses(STEPS, MB, GAS * 2 // world, world, CLIP)
    results = run_distributed(engine_losses, world, 2, STEPS, MB, GAS * 2 // world, CLIP, 1e-2, extra,
                              backend="nccl", timeout=300)
    for losses, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=3e-2, atol=1e-3)
