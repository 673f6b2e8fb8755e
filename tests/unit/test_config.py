"""Config: DeepSpeed keys and defaults; every mistake is a ConfigError naming the key."""

import json

import pytest

from zerospeed.config import ConfigError, NotSupportedYetError, load_config, resolve_batch


def test_defaults_match_deepspeed() -> None:
    cfg = load_config({"train_batch_size": 8}, 2)
    assert cfg.gradient_clipping == 0.0
    assert cfg.fp16.enabled is False and cfg.fp16.initial_scale_power == 16
    assert cfg.fp16.loss_scale_window == 1000 and cfg.fp16.hysteresis == 2 and cfg.fp16.min_loss_scale == 1
    assert cfg.zero_optimization.stage == 0
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.steps_per_print == 10


def test_json_path_and_bfloat16_alias(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": True}}))
    cfg = load_config(str(path), 4)
    assert cfg.bf16.enabled and cfg.batch(4).train_batch_size == 8


@pytest.mark.parametrize(
    ("tbs", "mb", "gas", "dp", "expected"),
    [
        (32, 4, None, 2, (32, 4, 4)),
        (32, None, 4, 2, (32, 4, 4)),
        (None, 4, 4, 2, (32, 4, 4)),
        (32, None, None, 4, (32, 8, 1)),
        (None, 3, None, 2, (6, 3, 1)),
        (32, 4, 4, 2, (32, 4, 4)),
    ],
)
def test_batch_rules(tbs, mb, gas, dp, expected) -> None:
    b = resolve_batch(tbs, mb, gas, dp)
    assert (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps) == expected


def test_auto_batch_values_are_derived() -> None:
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": "auto"}, 2)
    assert cfg.batch(2).train_batch_size == 4


def test_inconsistent_triple_shows_arithmetic() -> None:
    with pytest.raises(ConfigError, match=r"train_batch_size.*10 != .*\(4\).*\(2\).*\(2\) = 16"):
        load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2)


def test_impossible_batch_sizes() -> None:
    with pytest.raises(ConfigError, match="not divisible"):
        load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 2)
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu.*positive"):
        load_config({"train_micro_batch_size_per_gpu": 0}, 2)
    with pytest.raises(ConfigError, match="at least one"):
        load_config({}, 2)


def test_misspelled_keys_get_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"'gradient_acumulation_steps'.*Did you mean 'gradient_accumulation_steps'"):
        load_config({"train_batch_size": 8, "gradient_acumulation_steps": 2}, 2)
    with pytest.raises(ConfigError, match=r"'zero_optimization.reduce_bucket_sise'.*'reduce_bucket_size'"):
        load_config({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_sise": 10}}, 2)
    with pytest.raises(ConfigError, match=r"'fp16.initial_scale_pow'.*'initial_scale_power'"):
        load_config({"train_batch_size": 8, "fp16": {"initial_scale_pow": 8}}, 2)


def test_wrong_types_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"'fp16.enabled'.*'maybe'"):
        load_config({"train_batch_size": 8, "fp16": {"enabled": "maybe"}}, 2)
    with pytest.raises(ConfigError, match=r"'gradient_clipping'"):
        load_config({"train_batch_size": 8, "gradient_clipping": -1}, 2)
    with pytest.raises(ConfigError, match=r"'zero_optimization.stage'"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 7}}, 2)
    with pytest.raises(ConfigError, match=r"'zero_optimization'.*valid dictionary"):
        load_config({"train_batch_size": 8, "zero_optimization": 2}, 2)


def test_unimplemented_deepspeed_keys_are_not_ignored() -> None:
    with pytest.raises(NotSupportedYetError, match=r"'compression_training'.*not supported yet"):
        load_config({"train_batch_size": 8, "compression_training": {"weight_quantization": {}}}, 2)
    with pytest.raises(NotSupportedYetError, match=r"'zero_optimization.zero_quantized_gradients'"):
        load_config({"train_batch_size": 8, "zero_optimization": {"zero_quantized_gradients": True}}, 2)
    # switched off is honoured, not an error
    load_config({"train_batch_size": 8, "zero_optimization": {"zero_quantized_gradients": False},
                 "elasticity": {"enabled": False}}, 2)


def test_fp16_and_bf16_together_is_an_error() -> None:
    with pytest.raises(ConfigError, match="fp16 and bf16"):
        load_config({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 2)


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(bad))


def test_pipeline_section_has_deepspeeds_keys() -> None:
    cfg = load_config({"train_batch_size": 8, "pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}, 2)
    assert cfg.pipeline.activation_checkpoint_interval == 1 and cfg.pipeline.partition == "best"
    with pytest.raises(ConfigError, match=r"pipeline.*unknown key"):
        load_config({"train_batch_size": 8, "pipeline": {"stagez": 2}}, 2)
