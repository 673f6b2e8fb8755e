"""The ``pipeline`` section: keys the PipelineModule decides must agree with it (DeepSpeed ignores them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zerospeed.config import ConfigError
from zerospeed.config.pipeline import PipelineConfig
from zerospeed.parallel.pipeline.engine import check_pipeline_section

MODULE = SimpleNamespace(num_stages=2, partition_method="parameters", seed_layers=False, virtual_stages=1)


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


def test_eager_schedule_is_refused_with_virtual_stages_and_a_typo_is_refused() -> None:
    check_pipeline_section(PipelineConfig(schedule="eager_1f1b"), MODULE)
    interleaved = SimpleNamespace(**{**vars(MODULE), "virtual_stages": 2})
    with pytest.raises(ConfigError, match=r"pipeline\.schedule"):
        check_pipeline_section(PipelineConfig(schedule="eager_1f1b"), interleaved)
    with pytest.raises(Exception, match="eager_1f1b"):
        PipelineConfig(schedule="eager")
