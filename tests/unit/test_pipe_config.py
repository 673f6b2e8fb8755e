"""The ``pipeline`` section: keys the PipelineModule decides must agree with it (DeepSpeed ignores them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zerospeed.config import ConfigError
from zerospeed.config.pipeline import PipelineConfig
from zerospeed.parallel.pipeline.engine import check_pipeline_section

MODULE = SimpleNamespace(num_stages=2, partition_method="parameters", seed_layers=False)


def test_defaults_and_agreeing_values_pass() -> None:
    check_pipeline_section(PipelineConfig(), MODULE)
    check_pipeline_section(PipelineConfig(stages=2, partition="parameters"), MODULE)


@pytest.mark.parametrize(("section", "key"), [
    ({"stages": 4}, "pipeline.stages"),
    ({"partition": "uniform"}, "pipeline.partition"),
    ({"seed_layers": True}, "pipeline.seed_layers"),
])
def test_a_disagreeing_value_names_the_key(section: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_pipeline_section(PipelineConfig(**section), MODULE)
