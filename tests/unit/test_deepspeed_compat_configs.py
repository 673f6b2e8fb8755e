"""DeepSpeed's config objects under their DeepSpeed paths (issue 29): ``runtime.zero.config``,
``runtime.zero.offload_config``, ``runtime.config_utils.DeepSpeedConfigModel``, ``DeepSpeedConfig``'s batch
method and the optimizer names, and duplicate keys in a config file. No processes."""

from __future__ import annotations

from typing import List, Optional

import pytest
from pydantic import Field, ValidationError

import zerospeed  # noqa: F401  # installs the alias table
from zerospeed.config import ConfigError, load_config


def test_zero_config_reads_deepspeed_field_names() -> None:
    from zerospeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum

    cfg = DeepSpeedZeroConfig(stage=3, stage3_prefetch_bucket_size=123, stage3_max_reuse_distance=7,
                              stage3_gather_fp16_weights_on_model_save=True)
    assert cfg.stage == ZeroStageEnum.weights == 3
    assert (cfg.prefetch_bucket_size, cfg.max_reuse_distance, cfg.gather_16bit_weights_on_model_save) == (123, 7, True)
    assert cfg.reduce_bucket_size == 500_000_000 and cfg.pipeline_loading_checkpoint is False
    assert cfg.overlap_comm is True and DeepSpeedZeroConfig(stage=2).overlap_comm is False
    assert DeepSpeedZeroConfig(stage=2, overlap_comm=True).overlap_comm is True
    with pytest.raises(ConfigError, match="zero_optimization.stgae"):  # zerospeed's own validation and message
        DeepSpeedZeroConfig(stgae=1)


def test_zero_config_offload_sections_only_when_given() -> None:
    from zerospeed.runtime.zero.config import DeepSpeedZeroConfig, DeepSpeedZeroOffloadParamConfig
    from zerospeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, OffloadDeviceEnum

    assert DeepSpeedZeroConfig().offload_param is None and DeepSpeedZeroConfig().offload_optimizer is None
    assert DeepSpeedZeroConfig(offload_param=None).offload_param is None
    cfg = DeepSpeedZeroConfig(offload_param={}, offload_optimizer={"device": "cpu", "pipeline_read": True})
    assert isinstance(cfg.offload_param, DeepSpeedZeroOffloadParamConfig)
    assert isinstance(cfg.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert cfg.offload_optimizer.pipeline and cfg.offload_optimizer.device == OffloadDeviceEnum.cpu
    assert isinstance(DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert not DeepSpeedZeroOffloadOptimizerConfig().pipeline


class _Conf:
    """Built lazily: DeepSpeedConfigModel does not exist before issue 29's adapter."""

    @staticmethod
    def make() -> type:
        from zerospeed.runtime.config_utils import DeepSpeedConfigModel

        class Conf(DeepSpeedConfigModel):
            size: int = 0
            names_old: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "names",
                                                                      "new_param_fn": lambda v: [v]})
            names: Optional[List[str]] = None
            width: int = Field(0, alias="width_alias")

        return Conf


def test_config_model_deprecated_alias_auto_and_strictness() -> None:
    conf = _Conf.make()
    assert conf(names_old="a").names == ["a"]
    assert conf(width_alias=3).width == 3 and conf(width=4).width == 4
    assert conf(size="auto").size == 0  # DeepSpeed: "auto" keeps the default unless strict
    with pytest.raises(ValidationError):
        conf(strict=True, size="auto")
    with pytest.raises(ValidationError):
        conf(sise=1)
    with pytest.raises(AssertionError, match="names_old"):
        conf(names=["b"], names_old="a")


def test_deepspeed_config_batch_method_and_optimizer_names() -> None:
    from zerospeed.runtime.config import ADAM_OPTIMIZER, DEEPSPEED_OPTIMIZERS, DeepSpeedConfig

    assert zerospeed.DeepSpeedConfigError is ConfigError  # deepspeed.DeepSpeedConfigError
    assert (zerospeed.__version_major__, zerospeed.__version_minor__) == tuple(
        int(p) for p in zerospeed.__version__.split(".")[:2]) and zerospeed.__git_hash__ == "unknown"

    assert ADAM_OPTIMIZER == "adam" and "lamb" in DEEPSPEED_OPTIMIZERS
    cfg = DeepSpeedConfig({"train_batch_size": 8})
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = 32, 8, None
    cfg._configure_train_batch_size()
    assert cfg.gradient_accumulation_steps == 4
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = 33, 8, None
    with pytest.raises(AssertionError, match="divisible"):
        cfg._configure_train_batch_size()


@pytest.mark.parametrize("text", ['{"train_batch_size": 2, "train_batch_size": 4}',
                                  '{"train_batch_size": 2, "train_batch_size": 4,}'])  # the second is HJSON
def test_duplicate_key_in_config_file_is_an_error(tmp_path, text: str) -> None:
    pytest.importorskip("hjson")
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="train_batch_size.*twice"):
        load_config(str(path))
