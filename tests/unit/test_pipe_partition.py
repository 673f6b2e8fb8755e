"""PipelineModule partitioning (pure): DeepSpeed's stage boundaries for the same layers, and clear errors."""

import pytest
from torch import nn

from zerospeed.parallel.pipeline.module import LayerSpec, PipelineError, _count_params, compute_partition
from tests.dist.pipe_fixtures import gpt_layers


def test_parameter_counts_use_meta_builds() -> None:
    assert [_count_params(layer) for layer in gpt_layers()] == [640, 3280, 3280, 3280, 32, 640]


@pytest.mark.parametrize("stages,parameters,blocks,uniform", [
    (2, [0, 3, 6], [0, 3, 6], [0, 3, 6]),
    (3, [0, 2, 3, 6], [0, 2, 3, 6], [0, 2, 4, 6]),
    (4, [0, 2, 3, 4, 6], [0, 2, 3, 5, 6], [0, 2, 4, 5, 6]),
])
def test_boundaries_match_deepspeed(stages: int, parameters: list, blocks: list, uniform: list) -> None:
    # expected values: deepspeed 0.19.8's partition_balanced / partition_uniform on the same weights
    layers = gpt_layers()
    assert compute_partition(layers, stages, "parameters") == parameters
    assert compute_partition(layers, stages, "type:block") == blocks
    assert compute_partition(layers, stages, "uniform") == uniform


def test_type_regex_matching_no_layer_is_an_error() -> None:
    with pytest.raises(PipelineError, match="matches no layer type.*Block"):
        compute_partition(gpt_layers(), 2, "type:Conv2d")
    with pytest.raises(NotImplementedError, match="profile"):
        compute_partition(gpt_layers(), 2, "profile")


def test_layer_spec_needs_a_module_class() -> None:
    with pytest.raises(RuntimeError, match="only supports torch.nn.Module"):
        LayerSpec(int)
    assert repr(LayerSpec(nn.Linear, 2, 3, bias=False)) == "Linear(2, 3, bias=False)"
