"""ProcessTopology: DeepSpeed's rank layout, comm lists and coordinates (no processes)."""

import pytest

from zerospeed.parallel.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology,
                                         default_topology)


def test_row_major_layout_and_coords() -> None:
    topo = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert topo.get_rank(x=0, y=1) == 1 and topo.get_rank(x=1, y=0) == 3
    c = topo.get_coord(rank=1)
    assert (c.x, c.y) == (0, 1)
    assert topo.get_dim("y") == 3 and topo.get_dim("nope") == 0
    assert topo.get_axis_list(axis="x", idx=0) == [0, 1, 2]
    assert topo.get_axis_list(axis="y", idx=0) == [0, 3]
    assert topo.world_size() == 6
    with pytest.raises(ValueError, match="every axis"):
        topo.get_rank(x=0)
    with pytest.raises(ValueError, match="not found"):
        topo.get_coord(6)


def test_pipe_model_data_comm_lists() -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("expert") == []
    assert topo.filter_match(pipe=0, data=1) == [2, 3]
    assert topo.get_rank_repr(rank=3) == "model_01"
    assert topo.get_rank_repr(rank=3, omit_axes=["model"]) == "pipe_00-data_01"


def test_pipe_data_layout() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert [tuple(topo.get_coord(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert topo.get_axis_comm_lists("data") == [[0, 1], [2, 3]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 2], [1, 3]]
    assert topo.get_rank_repr(rank=2) == ""


@pytest.mark.parametrize("world,pp,dp", [(1, 1, 1), (2, 2, 1), (4, 2, 2), (8, 4, 2), (12, 6, 2), (6, 2, 3)])
def test_default_topology_alternates_prime_factors(world: int, pp: int, dp: int) -> None:
    topo = default_topology(world)
    assert (topo.get_dim("pipe"), topo.get_dim("data")) == (pp, dp)


def test_bad_topologies() -> None:
    with pytest.raises(ValueError, match="dims"):
        ProcessTopology(["a", "b"], [2])
    with pytest.raises(ValueError, match=">= 1"):
        ProcessTopology(["a"], [0])


def test_prime_factors_under_deepspeeds_path_ascend_with_repeats_and_refuse_zero() -> None:
    from zerospeed.runtime.pipe.topology import _prime_factors  # DeepSpeed's test module imports it

    assert [_prime_factors(n) for n in (1, 2, 12, 29, 30)] == [[], [2], [2, 2, 3], [29], [2, 3, 5]]
    with pytest.raises(ValueError, match="positive"):
        _prime_factors(0)
