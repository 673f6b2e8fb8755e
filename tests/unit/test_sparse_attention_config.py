"""The ``sparse_attention`` config section: DeepSpeed's keys and per-mode defaults, every key read or refused,
and the SparsityConfig a model builds from it."""

import pytest
import torch

from zerospeed.config import ConfigError, load_config
from zerospeed.ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    VariableSparsityConfig,
)


def section(**keys):
    return load_config({"train_batch_size": 1, "sparse_attention": keys}).sparse_attention


def test_absent_section_is_none_and_empty_section_is_deepspeeds_fixed_default() -> None:
    assert load_config({"train_batch_size": 1}).sparse_attention is None
    assert section().to_dict() == {
        "mode": "fixed", "block": 16, "different_layout_per_head": False, "num_local_blocks": 4,
        "num_global_blocks": 1, "attention": "bidirectional", "horizontal_global_attention": False,
        "num_different_global_patterns": 1}


def test_each_mode_reads_deepspeeds_keys_with_its_defaults() -> None:
    assert section(mode="dense", block=32).to_dict() == {"mode": "dense", "block": 32}
    assert section(mode="variable").to_dict() == {
        "mode": "variable", "block": 16, "different_layout_per_head": False, "num_random_blocks": 0,
        "local_window_blocks": [4], "global_block_indices": [0], "global_block_end_indices": None,
        "attention": "bidirectional", "horizontal_global_attention": False}
    big = section(mode="bigbird")
    assert big.to_dict() == {"mode": "bigbird", "block": 16, "different_layout_per_head": False,
                             "num_random_blocks": 0, "num_sliding_window_blocks": 3, "num_global_blocks": 1,
                             "attention": "bidirectional"}
    assert big["num_random_blocks"] == 0 and big.get("mode") == "bigbird"  # DeepSpeed's dict access
    assert section(mode="bslongformer", global_block_end_indices=[2]).to_dict() == {
        "mode": "bslongformer", "block": 16, "different_layout_per_head": False, "num_sliding_window_blocks": 3,
        "global_block_indices": [0], "global_block_end_indices": [2], "attention": "bidirectional"}


def test_sparsity_config_is_built_from_the_section() -> None:
    cfg = section(mode="fixed", block=32, different_layout_per_head=True, num_local_blocks=8, num_global_blocks=2,
                  num_different_global_patterns=4).sparsity_config(num_heads=8)
    assert isinstance(cfg, FixedSparsityConfig) and cfg.num_heads == 8 and cfg.block == 32
    assert (cfg.num_local_blocks, cfg.num_global_blocks, cfg.num_different_global_patterns) == (8, 2, 4)
    ref = FixedSparsityConfig(8, 32, True, 8, 2, num_different_global_patterns=4)
    assert torch.equal(cfg.make_layout(1024), ref.make_layout(1024))
    assert isinstance(section(mode="dense").sparsity_config(2), DenseSparsityConfig)
    var = section(mode="variable", local_window_blocks=[2, 4], global_block_indices=[1]).sparsity_config(2)
    assert isinstance(var, VariableSparsityConfig) and var.local_window_blocks == [2, 4]
    big = section(mode="bigbird", num_random_blocks=2, attention="unidirectional").sparsity_config(2)
    assert isinstance(big, BigBirdSparsityConfig) and big.num_random_blocks == 2 and big.attention == "unidirectional"
    assert isinstance(section(mode="bslongformer").sparsity_config(2), BSLongformerSparsityConfig)
    from zerospeed.sparse_attention import sparsity_config_from_section

    from_dict = sparsity_config_from_section({"mode": "bigbird", "block": 8, "num_random_blocks": 0}, num_heads=2)
    assert isinstance(from_dict, BigBirdSparsityConfig) and from_dict.block == 8  # DeepSpeed's dict works too
    with pytest.raises(NotImplementedError, match="sparsity mode, local"):
        sparsity_config_from_section({"mode": "local"}, num_heads=2)


def test_keys_a_mode_does_not_read_and_bad_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="sparse_attention.num_random_blocks.*'fixed' does not use"):
        section(num_random_blocks=2)
    with pytest.raises(ConfigError, match="sparse_attention.different_layout_per_head.*'dense'"):
        section(mode="dense", different_layout_per_head=True)
    with pytest.raises(ConfigError, match="sparse_attention.mode"):
        section(mode="longformer")
    with pytest.raises(ConfigError, match="sparse_attention.attention"):
        section(attention="causal")
    with pytest.raises(ConfigError, match="Did you mean 'num_local_blocks'"):
        section(num_local_block=4)
    with pytest.raises(ConfigError, match="sparse_attention.block"):
        section(block=0)
