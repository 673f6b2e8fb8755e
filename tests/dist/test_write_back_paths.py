"""ZeRO 1-2's write-back after the step (and ZeRO-3's parameter gathers) have paths that must give the same parameters: on Gloo, an
in-place all-gather straight into the parameters (the default there); the buffered, pipelined all-gather
(other backends: forced here by hiding the in-place path), and per-rank broadcasts (`allgather_partitions: false`).
Each is compared with the single-process reference."""

from __future__ import annotations

import pytest
import torch

from zerospeed.testing import run_distributed

from .parity import engine_losses, reference_losses

STEPS, MB, GAS, CLIP = 4, 2, 2, 1.0


def run(stage: int, path: str) -> tuple[list[float], dict[str, torch.Tensor], int]:
    from zerospeed import comm

    extra = {}
    if path == "buffered":
        comm.gathers_in_place = lambda *a, **k: False  # this forked rank only: take the backend-neutral path
    if path == "broadcast":
        extra = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300,
                                       "allgather_partitions": False}}
    comm.COMMS_LOGGER.reset()
    losses, state = engine_losses(stage, STEPS, MB, GAS, CLIP, extra=extra)
    gathers = comm.COMMS_LOGGER.snapshot().get("all_gather")
    return losses, state, 0 if gathers is None else int(gathers.count)


@pytest.mark.parametrize("stage,path", [(1, "in_place"), (1, "buffered"), (1, "broadcast"), (2, "in_place"),
                                        (2, "buffered"), (2, "broadcast"), (3, "in_place"), (3, "buffered")])
def test_write_back_paths_match_reference(stage: int, path: str) -> None:
    ref_losses, ref_state = reference_losses(STEPS, MB, GAS, 2, CLIP)
    for losses, state, gathers in run_distributed(run, 2, stage, path):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
        if stage == 3:
            continue
        if path == "in_place":  # one in-place all-gather per parameter group and step (buffered: one per run)
            assert gathers == STEPS * 2
        elif path == "buffered":
            assert gathers > STEPS * 2
