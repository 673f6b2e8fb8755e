"""bf16 and fp16 at world 2 reproduce the same run on one process (and stay near fp32 PyTorch).

Tolerances: against the same engine on one process (same precision, same global batch) the only
differences are the order of fp32 gradient sums and bf16/fp16 matmul blocking: rtol 2e-3. Against
fp32 PyTorch the half-precision forward itself differs: rtol 3e-2 on the loss.
"""

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import engine_losses, reference_losses

STEPS, MB, GAS, CLIP = 10, 2, 2, 0.5
PRECISIONS = {
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
}


@pytest.mark.parametrize(("stage", "world"), [(0, 2), (1, 2), (2, 2), (1, 4), (2, 4)])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_parity(precision: str, stage: int, world: int) -> None:
    extra = PRECISIONS[precision]
    (single, _), = run_distributed(engine_losses, 1, stage, STEPS, MB, GAS * world, CLIP, 1e-2, extra, timeout=120)
    results = run_distributed(engine_losses, world, stage, STEPS, MB, GAS, CLIP, 1e-2, extra, timeout=120)
    ref, _ = reference_losses(STEPS, MB, GAS, world, CLIP)
    for losses, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(single), rtol=2e-3, atol=1e-4)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=3e-2, atol=1e-3)
