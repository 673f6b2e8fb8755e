"""Ulysses head planning (pure): even, uneven and GQA splits, and the errors that name the numbers."""

from __future__ import annotations

import pytest
import torch

from zerospeed.parallel.sequence.all_to_all import head_to_seq, plan_heads, seq_to_head


def test_even_heads_split_evenly() -> None:
    p = plan_heads(8, 8, 4)
    assert (p.q_splits, p.kv_splits, p.kv_repeat) == ((2, 2, 2, 2), (2, 2, 2, 2), 1)


def test_uneven_heads_follow_deepspeed() -> None:  # 7 heads on 4 ranks: 2, 2, 2, 1
    p = plan_heads(7, 7, 4)
    assert p.q_splits == (2, 2, 2, 1) and p.kv_splits == (2, 2, 2, 1)


def test_gqa_query_heads_follow_their_kv_group() -> None:
    p = plan_heads(12, 3, 2)  # kv groups 2 + 1, four query heads per group
    assert p.kv_splits == (2, 1) and p.q_splits == (8, 4) and p.kv_repeat == 1


def test_fewer_kv_heads_than_ranks_repeat_them() -> None:
    p = plan_heads(8, 2, 4)
    assert p.kv_repeat == 2 and p.kv_splits == (1, 1, 1, 1) and p.q_splits == (2, 2, 2, 2)


@pytest.mark.parametrize("q,kv,world,words", [(6, 4, 2, "not a multiple of 4"), (6, 2, 4, "sequence-parallel size 4"),
                                              (4, 1, 3, "4 query / 1 key-value heads")])
def test_unsplittable_heads_name_the_numbers(q: int, kv: int, world: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        plan_heads(q, kv, world)


def test_world_one_is_identity() -> None:
    x = torch.randn(3, 5, 4, 2)
    assert seq_to_head(x, None, 1, 2, (4,)) is x and head_to_seq(x, None, 1, 2, (4,)) is x


# --- the (data, sequence) grid -----------------------------------------------------------------------------
def test_sequence_grid_puts_sequence_peers_adjacent() -> None:
    from zerospeed.parallel.sequence.groups import sequence_topology

    topo = sequence_topology(8, 2)
    assert topo.get_axis_comm_lists("sequence") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("data") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert sequence_topology(4, 4).get_axis_comm_lists("data") == [[0], [1], [2], [3]]


def test_sequence_size_must_divide_the_world() -> None:
    from zerospeed.parallel.sequence.groups import sequence_topology

    with pytest.raises(ValueError, match="sequence_parallel_size 3 does not divide the world size 4"):
        sequence_topology(4, 3)


def test_sequence_parallel_size_is_a_config_key() -> None:
    from zerospeed.config import load_config

    assert load_config({"train_batch_size": 8, "sequence_parallel_size": 2}).sequence_parallel_size == 2
    with pytest.raises(Exception, match="sequence_parallel_size"):
        load_config({"train_batch_size": 8, "sequence_parallel_size": 0})
