"""init_inference config: DeepSpeed's keys, dtype names, kwarg merge, and 'not supported yet' refusals."""

import pytest
import torch

from zerospeed.config import ConfigError, NotSupportedYetError
from zerospeed.inference.config import DeepSpeedInferenceConfig, load_inference_config, parse_dtype


@pytest.mark.parametrize("name,dtype", [
    ("fp16", torch.float16), ("half", torch.float16), ("float16", torch.float16), ("torch.float16", torch.float16),
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp32", torch.float32), ("float", torch.float32),
    ("float32", torch.float32), ("int8", torch.int8), (torch.bfloat16, torch.bfloat16), (torch.int8, torch.int8),
])
def test_dtype_names(name, dtype):
    assert parse_dtype(name) is dtype
    assert load_inference_config({"dtype": name}, {}).dtype is dtype


def test_defaults_are_deepspeeds():
    cfg = DeepSpeedInferenceConfig()
    assert cfg.dtype is torch.float16 and cfg.max_out_tokens == 1024 and cfg.min_out_tokens == 1
    assert cfg.tensor_parallel.tp_size == 1 and not cfg.replace_with_kernel_inject
    assert cfg.quant.weight.num_bits == 8 and cfg.weight_quantization is None  # default quant section is inert


def test_bad_dtype_and_unknown_key_name_the_key():
    with pytest.raises(ConfigError, match="dtype"):
        load_inference_config({"dtype": "fp8"}, {})
    with pytest.raises(ConfigError, match="max_out_token.*Did you mean 'max_out_tokens'"):
        load_inference_config({"max_out_token": 5}, {})


def test_aliases_and_kwargs_merge():
    cfg = load_inference_config({"tp": {"tp_size": 1}, "max_tokens": 64}, {"kernel_inject": True, "dtype": "fp32"})
    assert cfg.max_out_tokens == 64 and cfg.replace_with_kernel_inject and cfg.dtype is torch.float32


def test_conflicting_kwarg_is_value_error():
    with pytest.raises(ValueError, match="Conflicting argument 'dtype'"):
        load_inference_config({"dtype": "fp16"}, {"dtype": "fp32"})
    load_inference_config({"dtype": "fp16"}, {"dtype": "fp16"})  # same value twice is fine


def test_json_path(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text('{"dtype": "bf16", "max_out_tokens": 7}')
    cfg = load_inference_config(str(p), {})
    assert cfg.dtype is torch.bfloat16 and cfg.max_out_tokens == 7


@pytest.mark.parametrize("data,key", [
    ({"enable_cuda_graph": True}, "enable_cuda_graph"),
    ({"checkpoint": "ckpt.json"}, "checkpoint"),
    ({"moe": True}, "moe"),
    ({"zero": {"stage": 3}}, "zero"),
    ({"keep_module_on_host": True}, "keep_module_on_host"),
    ({"quant": {"activation": {"enabled": True}}}, "quant.activation.enabled"),
])
def test_unbuilt_features_refused_by_name(data, key):
    cfg = load_inference_config(data, {})
    with pytest.raises(NotSupportedYetError, match="not supported yet by zerospeed") as info:
        cfg.check_supported()
    assert key in str(info.value)


def test_kernel_inject_accepted_without_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_inference_config({"replace_with_kernel_inject": True}, {}).check_supported()


def test_weight_quantization_switch():
    assert load_inference_config({"dtype": "int8"}, {}).weight_quantization.num_bits == 8
    q = load_inference_config({"quant": {"weight": {"num_bits": 4, "q_type": "asymmetric", "q_groups": 2}}}, {})
    assert q.weight_quantization.num_bits == 4 and q.weight_quantization.q_groups == 2
    assert load_inference_config({"quant": {"enabled": False}}, {}).weight_quantization is None
    with pytest.raises(ConfigError, match="num_bits"):
        load_inference_config({"quant": {"weight": {"num_bits": 3}}}, {})
