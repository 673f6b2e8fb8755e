"""Stages 0, 1 and 2 reproduce one process: same seed, same global batch, fp32 within rtol 1e-5."""

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import engine_losses, reference_losses

STEPS, MB, GAS, CLIP = 10, 2, 2, 0.5


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp32_parity(stage: int, world: int) -> None:
    ref_losses, ref_state = reference_losses(STEPS, MB, GAS, world, CLIP)
    results = run_distributed(engine_losses, world, stage, STEPS, MB, GAS, CLIP, timeout=120)
    for losses, state in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=f"parameter {k}")


@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_parity_without_reduce_scatter_or_allgather(stage: int) -> None:
    """``reduce_scatter: false`` (all-reduce, keep the own partition) and ``allgather_partitions: false``
    (one broadcast per rank) compute the same step."""
    extra = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "reduce_scatter": False,
                                   "allgather_partitions": False, "overlap_comm": False}}
    ref_losses, _ = reference_losses(STEPS, MB, GAS, 2, CLIP)
    for losses, _ in run_distributed(engine_losses, 2, stage, STEPS, MB, GAS, CLIP, 1e-2, extra, timeout=120):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
