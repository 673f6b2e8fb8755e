"""Top-k sparsified all-reduce with error feedback equals a one-process simulation exactly, over several
calls (the residual carries what was not sent), at world 2 and 4; bytes are counted by the comms logger."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.comm.sparse import topk_count
from zerospeed.testing import run_distributed

N, RATIO, CALLS = 50, 0.1, 4


def data(call: int, rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(100 * call + rank))


def run() -> dict[str, Any]:
    from zerospeed import comm
    from zerospeed.comm.sparse import sparse_all_reduce

    rank = comm.get_rank()
    residual = torch.zeros(N)
    comm.COMMS_LOGGER.reset()
    out = []
    for call in range(CALLS):
        x = data(call, rank)
        sparse_all_reduce(x, RATIO, residual, comm.world_group())
        out.append((x.clone(), residual.clone()))
    return {"out": out, "bytes": comm.COMMS_LOGGER.snapshot()["all_gather"].bytes}


def simulate(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    k = topk_count(N, RATIO)
    residual = [torch.zeros(N) for _ in range(world)]
    results = []
    for call in range(CALLS):
        total = torch.zeros(N)
        for r in range(world):
            acc = residual[r] + data(call, r)
            idx = torch.topk(acc.abs(), k, sorted=False).indices
            total.index_add_(0, idx, acc[idx])
            acc[idx] = 0.0
            residual[r] = acc
        results.append([(total.clone(), residual[r].clone()) for r in range(world)])
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_sparse_all_reduce_equals_simulation(world: int) -> None:
    results = run_distributed(run, world, timeout=60)
    expected = simulate(world)
    for rank, r in enumerate(results):
        for call in range(CALLS):
            got, want = r["out"][call], expected[call][rank]
            torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)  # scatter-add order may differ
            assert torch.equal(got[1], want[1]), f"call {call} rank {rank}: residual differs"
        assert int((r["out"][-1][1] != 0).sum()) > N // 2, "the residual holds what was not sent"
    k = topk_count(N, RATIO)
    assert results[0]["bytes"] == CALLS * 2 * world * k * 4  # indices (int32) and values (fp32) gathered


def test_topk_count() -> None:
    assert [topk_count(n, 0.01) for n in (0, 1, 99, 100, 101)] == [0, 1, 1, 1, 2]
    assert topk_count(10, 1.0) == 10
