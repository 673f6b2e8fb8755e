"""The harness itself: results come back, a failing rank's traceback is shown, a hang hits the deadline."""

import time

import pytest
import torch

from zerospeed import comm
from zerospeed.testing import DistributedTestError, run_distributed


def _sum_ranks() -> float:
    t = torch.tensor([float(comm.get_rank() + 1)])
    comm.all_reduce(t)
    return float(t)


def _rank1_raises() -> None:
    if comm.get_rank() == 1:
        raise ValueError("boom on rank one")
    comm.barrier()


def _rank1_hangs() -> None:
    if comm.get_rank() == 1:
        time.sleep(60)
    comm.barrier()


def test_results_from_every_rank() -> None:
    assert run_distributed(_sum_ranks, 4) == [10.0] * 4


def test_failing_rank_traceback_is_shown() -> None:
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1.*ValueError: boom on rank one"):
        run_distributed(_rank1_raises, 2, timeout=30)


def test_hang_is_bounded() -> None:
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError):
        run_distributed(_rank1_hangs, 2, timeout=3)
    assert time.monotonic() - t0 < 15


def test_collective_timeout_names_rank_and_op() -> None:
    """With a short collective timeout the waiting rank fails itself, naming rank, op and group."""
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"rank 0: collective 'barrier' on group WORLD failed"):
        run_distributed(_rank1_hangs, 2, timeout=30, collective_timeout=2)
    assert time.monotonic() - t0 < 25
