"""``comm.all_gather_packed``: every rank's pieces (views into parameters, mixed dtypes, empty ones, one larger than
a chunk) reach every rank, in as few broadcasts as the chunk size allows, on the world and on a subgroup whose
group ranks differ from the global ones; counted as one all-gather of all the pieces' bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.comm.packed import plan_messages
from zerospeed.testing import run_distributed


def _pieces(world: int, me: int | None) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Three 'parameters' split into per-rank pieces; rank ``me`` fills its own with its values (None: the expected
    result, every rank's values)."""
    params = [torch.zeros(7 * world + 3), torch.zeros(3 * world), torch.zeros(4 * world, dtype=torch.float64),
              torch.zeros(40 * world)]
    pieces: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for k, p in enumerate(params):
        per = -(-p.numel() // world)
        for r in range(world):
            view = p[r * per:(r + 1) * per]
            pieces[r].append(view)
            if me is None or r == me:
                view.copy_(torch.arange(view.numel(), dtype=p.dtype) + 1000 * r + 100 * k)
        pieces[world - 1].append(p[:0])  # an empty piece
    return params, pieces


def run(chunk_bytes: int) -> dict[str, Any]:
    from zerospeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    params, pieces = _pieces(world, rank)
    log = comm.CommsLogger()
    with comm.recording(log):
        comm.all_gather_packed(pieces, chunk_bytes=chunk_bytes)
    want, _ = _pieces(world, None)
    out = {"world": all(torch.equal(a, b) for a, b in zip(params, want)),
           "counted": log.stats["all_gather"].count == 1 and log.stats["all_gather"].bytes == sum(t.numel() * t.element_size() for row in pieces for t in row)}
    odd = comm.new_group([r for r in range(world) if r % 2 == 1])
    if rank % 2 == 1:
        n, me = world // 2, rank // 2
        params, pieces = _pieces(n, me)
        comm.all_gather_packed(pieces, group=odd, chunk_bytes=chunk_bytes)
        want, _ = _pieces(n, None)
        out["sub"] = all(torch.equal(a, b) for a, b in zip(params, want))
    comm.barrier()
    return out


def test_plan_packs_small_pieces_and_sends_large_ones_alone() -> None:
    _, pieces = _pieces(2, None)  # rank 0: 9, 3 fp32, 4 fp64, 40 fp32; rank 1: 8, 3, 4, 40 (and empty pieces)
    msgs = plan_messages(pieces, chunk_bytes=100)
    # [9 + 3 fp32 = 48 B] | [4 fp64] (a dtype change) | [40 fp32 = 160 B > 100, alone]
    assert [(m.root, [t.numel() for t in m.pieces]) for m in msgs] == [(0, [9, 3]), (0, [4]), (0, [40]),
                                                                       (1, [8, 3]), (1, [4]), (1, [40])]
    assert [m.packed for m in msgs] == [True, False, False] * 2
    assert [len(m.pieces) for m in plan_messages(pieces, chunk_bytes=40)][:2] == [1, 1]  # 36 + 12 > 40
    msgs = plan_messages([[torch.zeros(3), torch.zeros(5), torch.zeros(2)]], chunk_bytes=1 << 20)
    assert len(msgs) == 1 and msgs[0].packed


@pytest.mark.parametrize("chunk_bytes", [16 << 20, 48])
def test_packed_gather(chunk_bytes: int) -> None:
    results = run_distributed(run, 4, chunk_bytes, timeout=120)
    for rank, r in enumerate(results):
        assert r["world"] and r["counted"], (rank, r)
        if rank % 2 == 1:
            assert r["sub"], (rank, r)
