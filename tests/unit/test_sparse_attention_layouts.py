"""Sparsity layouts: DeepSpeed's patterns block for block (expected rows written out; the random ones were
produced by DeepSpeed 0.19.6's sparsity_config.py with the same ``random.seed``), and its rules."""

import random

import pytest
import torch

from zerospeed.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)


def rows(layout: torch.Tensor, head: int = 0) -> list[str]:
    return ["".join(str(int(x)) for x in row) for row in layout[head]]


def test_fixed_bidirectional_local_windows_and_last_block_global() -> None:
    # windows {0..3}, {4,5}; block 3 (last of the first window) and, for the short last window, block 5
    layout = FixedSparsityConfig(num_heads=2, block=16).make_layout(96)
    assert layout.shape == (2, 6, 6) and layout.dtype == torch.int64
    assert rows(layout) == ["111101", "111101", "111101", "111101", "000111", "000111"]
    assert torch.equal(layout[1], layout[0])  # one layout for all heads


def test_fixed_unidirectional_is_lower_triangular_windows() -> None:
    layout = FixedSparsityConfig(num_heads=1, block=16, attention="unidirectional").make_layout(96)
    assert rows(layout) == ["100000", "110000", "111000", "111100", "000110", "000111"]


def test_fixed_different_global_patterns_per_head_and_horizontal() -> None:
    cfg = FixedSparsityConfig(num_heads=2, block=16, different_layout_per_head=True, num_local_blocks=2,
                              num_global_blocks=1, horizontal_global_attention=True, num_different_global_patterns=2)
    layout = cfg.make_layout(80)
    assert rows(layout, 0) == ["11011", "11111", "01111", "11111", "11111"]
    assert rows(layout, 1) == ["11111", "11101", "11111", "10111", "11111"]


def test_variable_windows_list_and_global_ranges() -> None:
    cfg = VariableSparsityConfig(num_heads=1, block=16, local_window_blocks=[1, 2], global_block_indices=[0, 4],
                                 global_block_end_indices=[1, 6], horizontal_global_attention=True)
    assert rows(cfg.make_layout(112)) == ["1111111", "1110110", "1110110", "1001110", "1111111", "1111111",
                                         "1000111"]


def test_random_blocks_match_deepspeed_under_the_same_seed() -> None:
    random.seed(0)
    layout = BigBirdSparsityConfig(num_heads=2, block=16, different_layout_per_head=True,
                                   num_random_blocks=1).make_layout(96)
    assert rows(layout, 0) == ["111111", "111100", "111100", "101110", "100111", "100111"]
    assert rows(layout, 1) == ["111111", "111000", "111100", "101110", "100111", "110011"]
    random.seed(7)
    layout = VariableSparsityConfig(num_heads=1, block=16, num_random_blocks=1,
                                    attention="unidirectional").make_layout(80)
    assert rows(layout) == ["10100", "11000", "11110", "11110", "10001"]


def test_seed_keyword_gives_a_private_reproducible_stream() -> None:
    a = BigBirdSparsityConfig(num_heads=4, block=16, different_layout_per_head=True, num_random_blocks=2, seed=5)
    b = BigBirdSparsityConfig(num_heads=4, block=16, different_layout_per_head=True, num_random_blocks=2, seed=5)
    random.seed(1)
    la = a.make_layout(256)
    random.seed(2)
    assert torch.equal(la, b.make_layout(256))
    assert not torch.equal(la[0], la[1])  # different random blocks per head


def test_bslongformer_unidirectional_and_local_sliding_window() -> None:
    layout = BSLongformerSparsityConfig(num_heads=1, block=16, global_block_indices=[2],
                                        attention="unidirectional").make_layout(80)
    assert rows(layout) == ["10000", "11000", "11100", "00110", "00111"]
    assert rows(LocalSlidingWindowSparsityConfig(num_heads=1, block=16).make_layout(64)) == \
        ["1000", "1100", "0110", "0011"]
    assert rows(LocalSlidingWindowSparsityConfig(1, 16, attention="bidirectional").make_layout(64)) == \
        ["1100", "1110", "0111", "0011"]


def test_bigbird_global_rows_and_columns_and_unidirectional_tril() -> None:
    layout = BigBirdSparsityConfig(num_heads=1, block=8, num_random_blocks=0, num_global_blocks=2).make_layout(48)
    assert rows(layout) == ["111111", "111111", "111100", "111110", "110111", "110011"]
    uni = BigBirdSparsityConfig(num_heads=1, block=8, num_random_blocks=0, attention="unidirectional").make_layout(48)
    assert torch.equal(uni, torch.tril(uni)) and uni.sum() > 0


def test_dense_and_rules() -> None:
    assert int(DenseSparsityConfig(num_heads=3, block=4).make_layout(16).sum()) == 3 * 16
    with pytest.raises(ValueError, match="dividable by Block size"):
        FixedSparsityConfig(num_heads=1, block=16).make_layout(40)
    with pytest.raises(ValueError, match="must be dividable by number of global blocks"):
        FixedSparsityConfig(num_heads=1, num_local_blocks=4, num_global_blocks=3)
    with pytest.raises(NotImplementedError, match="uni"):
        FixedSparsityConfig(num_heads=1, attention="causal")
    with pytest.raises(ValueError, match="horizontal"):
        VariableSparsityConfig(num_heads=1, attention="unidirectional", horizontal_global_attention=True)
    with pytest.raises(ValueError, match="different_layout_per_head"):
        FixedSparsityConfig(num_heads=2, num_different_global_patterns=2)
    with pytest.raises(ValueError, match="cannot be larger"):
        FixedSparsityConfig(num_heads=2, different_layout_per_head=True, num_different_global_patterns=5)
    with pytest.raises(ValueError, match="same length"):
        BSLongformerSparsityConfig(num_heads=1, global_block_indices=[0, 3], global_block_end_indices=[2])
    with pytest.raises(ValueError, match="smaller than its end"):
        VariableSparsityConfig(num_heads=1, global_block_indices=[3], global_block_end_indices=[3])
    with pytest.raises(ValueError, match="random blocks"):
        BigBirdSparsityConfig(num_heads=1, block=16, num_random_blocks=5).make_layout(64)
    with pytest.raises(NotImplementedError, match="defines no layout"):
        SparsityConfig(num_heads=4).make_layout(64)


@pytest.mark.parametrize("path,names", [
    ("zerospeed.ops.sparse_attention", ["SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig",
                                        "VariableSparsityConfig", "BigBirdSparsityConfig", "BSLongformerSparsityConfig",
                                        "LocalSlidingWindowSparsityConfig", "SparseSelfAttention",
                                        "BertSparseSelfAttention", "SparseAttentionUtils"]),
    ("zerospeed.ops.sparse_attention.sparsity_config", ["FixedSparsityConfig", "BigBirdSparsityConfig"]),
    ("zerospeed.ops.sparse_attention.sparse_self_attention", ["SparseSelfAttention"]),
    ("zerospeed.ops.sparse_attention.bert_sparse_self_attention", ["BertSparseSelfAttention"]),
    ("zerospeed.ops.sparse_attention.sparse_attention_utils", ["SparseAttentionUtils"]),
])
def test_deepspeed_import_paths(path: str, names: list[str]) -> None:
    import importlib

    module = importlib.import_module(path)
    assert all(hasattr(module, n) for n in names), [n for n in names if not hasattr(module, n)]
    from zerospeed.ops.adam import FusedAdam  # the optimizer paths under zerospeed.ops still resolve

    assert FusedAdam is not None
