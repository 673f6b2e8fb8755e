"""UlyssesSPDataLoaderAdapter on real ranks: every rank gets its slice of each sequence-group peer's batch in
turn, with global position_ids and pre-shifted labels (-100 after the last token); and sequence_mean_loss."""

from __future__ import annotations

import torch

from zerospeed import comm
from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter, sequence_mean_loss
from zerospeed.testing import run_distributed


def _batches(rank: int) -> list[dict]:
    n = 6 if rank == 0 else 4  # peers' batches may differ in length
    ids = torch.arange(n).unsqueeze(0) + 10 * (rank + 1)
    return [{"input_ids": ids, "position_ids": torch.arange(n).unsqueeze(0), "labels": ids.clone(),
             "tag": f"from{rank}"}]


def _adapt() -> list[dict]:
    rank = comm.get_rank()
    dl = UlyssesSPDataLoaderAdapter(_batches(rank), rank, None, 2, "cpu")
    assert len(dl) == 2
    out = [{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in b.items()} for b in dl]
    return out


def test_adapter_slices_positions_and_shifted_labels() -> None:
    r0, r1 = run_distributed(_adapt, 2)
    # iteration 0: rank 0's sample [10..15]; iteration 1: rank 1's sample [20..23]
    assert r0[0] == {"input_ids": [[10, 11, 12]], "position_ids": [[0, 1, 2]], "shift_labels": [[11, 12, 13]],
                     "tag": "from0"}
    assert r1[0] == {"input_ids": [[13, 14, 15]], "position_ids": [[3, 4, 5]], "shift_labels": [[14, 15, -100]],
                     "tag": "from0"}
    assert r0[1] == {"input_ids": [[20, 21]], "position_ids": [[0, 1]], "shift_labels": [[21, 22]], "tag": "from1"}
    assert r1[1] == {"input_ids": [[22, 23]], "position_ids": [[2, 3]], "shift_labels": [[23, -100]], "tag": "from1"}


def _missing_positions() -> str:
    dl = UlyssesSPDataLoaderAdapter([{"input_ids": torch.zeros(1, 4), "labels": torch.zeros(1, 4)}], 0, None, 2,
                                    "cpu")
    try:
        next(dl)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_adapter_requires_position_ids() -> None:
    assert all("position_ids" in m for m in run_distributed(_missing_positions, 2))


def _mean_loss() -> tuple[float, float]:
    rank = comm.get_rank()
    local = torch.tensor([1.0, 2.0, 3.0]) if rank == 0 else torch.tensor([5.0])  # token losses, uneven counts
    w = torch.tensor(2.0, requires_grad=True)
    loss = sequence_mean_loss((local * w).mean(), local.numel(), None)
    loss.backward()
    grad = w.grad.clone()
    comm.all_reduce(grad)  # the engine averages over the ranks: sum / world
    return loss.item(), grad.item() / 2


def test_sequence_mean_loss_is_the_unsharded_mean_and_gradient() -> None:
    for loss, grad in run_distributed(_mean_loss, 2):
        assert abs(loss - 2.0 * 11 / 4) < 1e-6  # mean of 2 * [1, 2, 3, 5]
        assert abs(grad - 11 / 4) < 1e-6
