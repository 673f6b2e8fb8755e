"""Expert group layout with pipeline and tensor parallelism: DeepSpeed 0.19.8's ``_get_expert_parallel_ranks``
(its outputs recorded below) from our grid's data-parallel groups."""

from __future__ import annotations

import pytest

from zerospeed.parallel.expert.groups import expert_rank_lists
from zerospeed.parallel.topology import PipeModelDataParallelTopology

# (world, tp, ep, pp, data_before) -> DeepSpeed's (expert-parallel, expert-data-parallel) rank lists
DEEPSPEED = {
    (16, 2, 4, 1, False): ([[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]],
                           [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]),
    (16, 2, 4, 1, True): ([[0, 4, 8, 12], [2, 6, 10, 14], [1, 5, 9, 13], [3, 7, 11, 15]],
                          [[0, 2], [4, 6], [8, 10], [12, 14], [1, 3], [5, 7], [9, 11], [13, 15]]),
    (8, 1, 2, 2, False): ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]]),
    (8, 1, 2, 2, True): ([[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (8, 2, 2, 2, False): ([[0, 2], [1, 3], [4, 6], [5, 7]], [[0], [2], [1], [3], [4], [6], [5], [7]]),
    (4, 1, 2, 1, True): ([[0, 2], [1, 3]], [[0, 1], [2, 3]]),
}


@pytest.mark.parametrize("key", sorted(DEEPSPEED))
def test_expert_groups_inside_the_grids_data_parallel_groups_match_deepspeed(key) -> None:
    world, tp, ep, pp, data_before = key
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (pp * tp))
    got = expert_rank_lists(topo.get_axis_comm_lists("data"), ep, data_before)
    want = DEEPSPEED[key]
    assert sorted(got[0]) == sorted(want[0]) and sorted(got[1]) == sorted(want[1])


def test_ep_must_divide_each_data_parallel_group() -> None:
    with pytest.raises(ValueError, match="must divide"):
        expert_rank_lists([[0, 1, 2]], 2)
