"""Hierarchical collectives on 2 simulated nodes x 2 ranks (world 4): same results as the flat collectives,
inter-node bytes cut by ranks_per_node for the all-reduce, bytes logged per level."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zerospeed.comm.hierarchy import NodeLayout
from zerospeed.testing import run_distributed


def test_node_layout() -> None:
    lay = NodeLayout(8, 4)
    assert lay.nodes == 2 and lay.node_of(5) == 1 and lay.local_rank(5) == 1
    assert lay.intra_ranks(1) == [4, 5, 6, 7] and lay.inter_ranks(2) == [2, 6]
    with pytest.raises(ValueError, match="must divide"):
        NodeLayout(6, 4)


def run() -> dict[str, Any]:
    from zerospeed import comm
    from zerospeed.comm.hierarchy import (Hierarchy, hierarchical_all_gather, hierarchical_all_reduce,
                                          hierarchical_reduce_scatter)

    rank, world = comm.get_rank(), comm.get_world_size()
    h = Hierarchy(ranks_per_node=2)
    x = torch.arange(10, dtype=torch.float32) * (rank + 1)  # integers: sums are exact in any order
    comm.COMMS_LOGGER.reset()
    ar = x.clone()
    hierarchical_all_reduce(ar, h)
    ar_stats = comm.COMMS_LOGGER.snapshot()
    flat = x.clone()
    comm.all_reduce(flat)
    chunks = torch.arange(world * 3, dtype=torch.float32) + 100 * rank
    rs = torch.empty(3)
    hierarchical_reduce_scatter(rs, chunks, h)
    rs_flat = torch.empty(3)
    comm.reduce_scatter(rs_flat, chunks.clone())
    ag = torch.empty(world * 3)
    hierarchical_all_gather(ag, torch.full((3,), float(rank)), h)
    return {"ar": ar, "flat": flat, "rs": rs, "rs_flat": rs_flat, "ag": ag,
            "inter_ar": ar_stats["inter:all_reduce"].bytes, "intra_rs": ar_stats["intra:reduce_scatter"].bytes}


def test_two_nodes_of_two() -> None:
    for rank, r in enumerate(run_distributed(run, 4, timeout=60)):
        assert torch.equal(r["ar"], r["flat"])
        assert torch.equal(r["rs"], r["rs_flat"])
        assert torch.equal(r["ag"], torch.arange(4, dtype=torch.float32).repeat_interleave(3))
        assert r["inter_ar"] == 10 // 2 * 4  # half the 10 fp32 values cross the node boundary
        assert r["intra_rs"] == 10 * 4
