"""DeepSpeed names that its own unit tests import (issue 29), served by zerospeed/compat/ and small additions."""

from __future__ import annotations

import pickle

import pytest
import torch

import zerospeed  # noqa: F401  # installs the alias table


def test_config_errors_pickle_with_their_fields():
    from zerospeed.config.errors import ConfigError, NotSupportedYetError, UnknownKeyError

    for err in (ConfigError("a.b", "bad"), NotSupportedYetError("x", "later"), UnknownKeyError("a.c", ("a", "c"), " Did you mean 'b'?")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.key == err.key
    assert pickle.loads(pickle.dumps(UnknownKeyError("k", ("k",), "h"))).loc == ("k",)


def test_deepspeed_config_object():
    from zerospeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from zerospeed.config import ConfigError

    cfg = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                           "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (6, 2, 3)
    assert cfg.zero_optimization_stage == 2 and cfg.zero_enabled and cfg.bfloat16_enabled and not cfg.fp16_enabled
    assert DeepSpeedConfigError is ConfigError
    with pytest.raises(DeepSpeedConfigError):
        DeepSpeedConfig({"train_batch_size": 8, "zero_optimisation": {}})


def test_precision_config_and_torch_version():
    from zerospeed.runtime.precision_config import DeepSpeedFP16Config, get_bfloat16_config, get_float16_config
    from zerospeed.utils.torch import required_torch_version

    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled  # DeepSpeed's old section name
    assert get_float16_config({"fp16": {"loss_scale_window": 7}}).loss_scale_window == 7
    assert isinstance(get_float16_config({}), DeepSpeedFP16Config)
    assert required_torch_version(min_version=1.9) and not required_torch_version(max_version="1.0")
    with pytest.raises(ValueError):
        required_torch_version()


def test_op_builders_answer_for_zerospeed():
    import zerospeed.ops as ops
    from zerospeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, InferenceBuilder

    assert CPUAdamBuilder.NAME == "cpu_adam" and CPUAdamBuilder().is_compatible()
    assert ops.__compatible_ops__[FusedAdamBuilder.NAME] is True
    assert not InferenceBuilder().is_compatible()
    with pytest.raises(NotImplementedError, match="transformer_inference"):
        InferenceBuilder().load()


def test_engine_name_accelerator_and_comm_names(monkeypatch):
    import zerospeed.comm as dist
    from zerospeed.accelerator import CpuAccelerator, is_current_accelerator_supported
    from zerospeed.runtime.engine import DeepSpeedEngine, Engine

    assert DeepSpeedEngine is Engine and is_current_accelerator_supported()
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert CpuAccelerator().device_count() == 4
    out = torch.zeros(3)
    dist.all_gather_into_tensor(out, torch.arange(3.0))  # world of one: a copy
    assert out.tolist() == [0.0, 1.0, 2.0] and dist.get_global_rank(None, 0) == 0
    dist.configure(enabled=True, prof_ops=["all_reduce"])
    try:
        assert dist.COMMS_LOGGER.enabled and dist.COMMS_LOGGER.prof_ops == ["all_reduce"]
    finally:
        dist.configure(enabled=False, prof_ops=[])


def test_partition_parameters_status_and_version_info():
    from zerospeed.git_version_info import installed_ops, torch_info
    from zerospeed.runtime.zero.partition_parameters import ZeroParamStatus, is_zero_param, param_status

    plain = torch.nn.Parameter(torch.zeros(2))
    assert param_status(plain) is ZeroParamStatus.AVAILABLE and not is_zero_param(plain)
    assert torch_info["version"] == ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert not any(installed_ops.values())  # zerospeed compiles no ops


def test_core_range_list():
    from zerospeed.utils.numa import parse_range_list

    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2", "1-2-3"):
        with pytest.raises(ValueError):
            parse_range_list(bad)


def test_hjson_config_file(tmp_path):
    pytest.importorskip("hjson")
    from zerospeed.config import ConfigError, load_config

    f = tmp_path / "ds_config.hjson"
    f.write_text("{\n  # a comment, as DeepSpeed's HJSON reader allows\n  train_batch_size: 4\n}\n")
    assert load_config(str(f)).train_batch_size == 4
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(bad))


def test_lr_schedule_constants_name_our_schedulers():
    from zerospeed.optim.schedules import SCHEDULER_NAMES
    from zerospeed.runtime import lr_schedules

    assert set(lr_schedules.VALID_LR_SCHEDULES) == set(SCHEDULER_NAMES)
    assert lr_schedules.WARMUP_NUM_STEPS == "warmup_num_steps" and lr_schedules.WarmupLR.__name__ == "WarmupLR"


def test_mics_init_has_deepspeeds_signature_and_is_refused_by_name():
    """zerospeed's stage 3 refuses a model built under zero.Init with mics_shard_size, so DeepSpeed's MiCS_Init
    is refused at once, naming itself; disabled, it is a block with no effect (as in DeepSpeed)."""
    import inspect

    from zerospeed.config import NotSupportedYetError
    from zerospeed.runtime.zero import MiCS_Init as via_runtime_zero
    from zerospeed.runtime.zero.mics import MiCS_Init
    from zerospeed.zero import Init

    assert MiCS_Init is zerospeed.zero.MiCS_Init is via_runtime_zero and issubclass(MiCS_Init, Init)
    assert list(inspect.signature(MiCS_Init).parameters) == [
        "module", "data_parallel_group", "sequence_data_parallel_group", "mem_efficient_linear", "remote_device",
        "pin_memory", "config_dict_or_path", "config", "enabled", "dtype", "mpu"]
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "mics_shard_size": 1}}
    with pytest.raises(NotSupportedYetError, match="MiCS_Init") as err:
        MiCS_Init(config_dict_or_path=config)
    assert err.value.key == "zero_optimization.mics_shard_size"
    with MiCS_Init(config_dict_or_path=config, enabled=False):
        layer = torch.nn.Linear(3, 2)
    assert layer.weight.shape == (2, 3) and not hasattr(layer.weight, "ds_id")
