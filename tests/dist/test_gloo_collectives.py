"""Gloo's reduce-scatter (of a scratch input: a pair exchange at two ranks, one reduce per rank above) and all-gather
(one broadcast per rank): the same results as the definitions (integers, so sums are exact), on the world and on a subgroup whose group ranks differ
from global ranks, synchronous and async; ``input`` is left alone unless the caller gave it as scratch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.testing import run_distributed


def run() -> dict[str, Any]:
    from zerospeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    out: dict[str, Any] = {}
    width = 5
    x = torch.arange(world * width, dtype=torch.float32) * (rank + 1) + 7 * rank
    expect = sum(torch.arange(world * width, dtype=torch.float32) * (r + 1) + 7 * r for r in range(world))
    keep = x.clone()
    mine = torch.empty(width)
    comm.reduce_scatter(mine, x)
    out["rs"] = torch.equal(mine, expect.view(world, width)[rank]) and torch.equal(x, keep)
    mine2 = torch.empty(width)
    h = comm.reduce_scatter(mine2, x.clone(), async_op=True, scratch=True)
    h.wait()
    out["rs_async"] = torch.equal(mine2, mine)
    # several in flight at once, completed out of launch order, with a collective between
    ins = [torch.arange(world * width, dtype=torch.float32) * (rank + 1) + k for k in range(3)]
    outs = [torch.empty(width) for _ in ins]
    hs = [comm.reduce_scatter(o, i, async_op=True, scratch=True) for o, i in zip(outs, ins)]
    comm.barrier()
    for h in reversed(hs):
        h.wait()
    out["rs_many"] = all(torch.equal(o, expect.view(world, width)[rank] - 7 * sum(range(world)) + world * k)
                         for k, o in enumerate(outs))
    full = torch.empty(world * 3)
    comm.all_gather(full, torch.full((3,), float(rank)))
    out["ag"] = torch.equal(full, torch.arange(world).float().repeat_interleave(3))
    full2 = torch.empty(world, 3)  # stack form, async
    comm.all_gather(full2, torch.full((3,), float(rank)), async_op=True).wait()
    out["ag_async"] = torch.equal(full2.view(-1), full)
    # a subgroup of the odd ranks: group rank 0 is global rank 1
    odd = comm.new_group([r for r in range(world) if r % 2 == 1])
    if rank % 2 == 1:
        n = len([r for r in range(world) if r % 2 == 1])
        me = rank // 2
        y = torch.arange(n * 2, dtype=torch.float32) + rank
        got = torch.empty(2)
        comm.reduce_scatter(got, y.clone(), group=odd, scratch=True)
        want = sum(torch.arange(n * 2, dtype=torch.float32) + r for r in range(world) if r % 2 == 1)
        g = torch.empty(n * 2)
        comm.all_gather(g, got, group=odd)
        out["sub"] = torch.equal(got, want.view(n, 2)[me]) and torch.equal(g, want)
    comm.barrier()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_by_root_collectives_equal_definitions(world: int) -> None:
    for res in run_distributed(run, world):
        assert all(res.values()), res
