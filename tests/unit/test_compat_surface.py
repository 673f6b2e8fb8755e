"""DeepSpeed names scripts import and call, without processes: arguments, config as a dict, dotted keys,
steps_per_print=inf, accelerator methods, optimizer classes, logging, import paths."""

from __future__ import annotations

import argparse
import importlib
import logging

import pytest
import torch

import zerospeed
from zerospeed.config import ConfigError, NotSupportedYetError, load_config


def test_add_config_arguments() -> None:
    parser = zerospeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    assert parser.parse_args([]).deepscale_config is None


def test_steps_per_print_infinity(tmp_path) -> None:
    assert load_config({"train_batch_size": 1, "steps_per_print": float("inf")}).steps_per_print is None
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 1, "steps_per_print": Infinity}')  # what json.dump(inf) writes
    assert load_config(str(path)).steps_per_print is None
    with pytest.raises(ConfigError):
        load_config({"train_batch_size": 1, "steps_per_print": 0})


def test_dotted_top_level_keys_expand() -> None:
    cfg = load_config({"train_batch_size": 2, "zero_optimization.stage": 2,
                       "zero_optimization.offload_optimizer.device": "cpu", "fp16": {"enabled": False}})
    assert cfg.zero_stage == 2 and cfg.zero_optimization.offload_optimizer.device == "cpu"
    with pytest.raises(ConfigError, match="also given nested"):
        load_config({"train_batch_size": 2, "zero_optimization": {"stage": 1}, "zero_optimization.stage": 2})
    with pytest.raises(ConfigError, match="stge"):
        load_config({"train_batch_size": 2, "zero_optimization.stge": 2})  # still checked like a nested key


def test_config_reads_like_deepspeeds_dict() -> None:
    raw = {"train_batch_size": 4, "zero_optimization": {"stage": 1}}
    cfg = load_config(raw)
    assert cfg["train_batch_size"] == 4 and cfg["zero_optimization"] == {"stage": 1}
    assert "zero_optimization" in cfg and "fp16" not in cfg
    assert cfg["fp16"]["enabled"] is False  # a section not written: its defaults
    assert cfg.get("nope", 7) == 7 and set(cfg.keys()) == {"train_batch_size", "zero_optimization"}
    d = cfg.to_dict()
    d["zero_optimization"]["stage"] = 3
    assert cfg["zero_optimization"]["stage"] == 1 and raw["zero_optimization"]["stage"] == 1
    with pytest.raises(KeyError):
        cfg["nope"]


def test_accelerator_methods() -> None:
    from zerospeed.accelerator import get_accelerator

    acc = get_accelerator()
    # DeepSpeed's: "cuda:1" with an index on CUDA, "cpu" whatever the index on the CPU
    assert acc.device_name() in ("cpu", "cuda")
    assert acc.device_name(1) == ("cpu" if acc.device_name() == "cpu" else f"{acc.device_name()}:1")
    assert acc.current_device_name().startswith(acc.device_name())
    assert acc.communication_backend_name() in ("gloo", "nccl") and acc.is_available()
    assert isinstance(acc.is_fp16_supported(), bool) and isinstance(acc.is_bf16_supported(), bool)
    assert torch.float32 in acc.supported_dtypes() and acc.total_memory() >= acc.available_memory() > 0
    acc.synchronize()
    acc.set_device(0)
    acc.manual_seed(3)
    assert acc.on_accelerator(torch.zeros(1, device=acc.device()))


def test_local_rank_from_launcher(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert zerospeed.comm.get_local_rank() == 3
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    assert zerospeed.comm.get_local_rank() == 2


def _steps(opt_cls, **kw) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = opt_cls([w], **kw)
    for _ in range(3):
        opt.zero_grad()
        (w.sin().sum() + w.square().sum()).backward()
        opt.step()
    return w.detach()


def test_deepspeed_optimizer_classes_match_torch() -> None:
    from zerospeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    ref_w = _steps(torch.optim.AdamW, lr=0.1, weight_decay=0.1)
    ref_l2 = _steps(torch.optim.Adam, lr=0.1, weight_decay=0.1)
    torch.testing.assert_close(_steps(DeepSpeedCPUAdam, lr=0.1, weight_decay=0.1), ref_w)
    torch.testing.assert_close(_steps(FusedAdam, lr=0.1, weight_decay=0.1), ref_w)
    torch.testing.assert_close(_steps(DeepSpeedCPUAdam, lr=0.1, weight_decay=0.1, adamw_mode=False), ref_l2)
    torch.testing.assert_close(_steps(FusedAdam, lr=0.1, weight_decay=0.1, adam_w_mode=False), ref_l2)
    with pytest.raises(NotSupportedYetError):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(1))], bias_correction=False)
    from zerospeed.offload.cpu_adam import ADAM, ADAMW, kernel_for

    p = [torch.nn.Parameter(torch.ones(1))]
    assert kernel_for(DeepSpeedCPUAdam(p)) is ADAMW and kernel_for(DeepSpeedCPUAdam(p, adamw_mode=False)) is ADAM


def test_log_dist(caplog) -> None:
    from zerospeed.utils import log_dist, logger

    with caplog.at_level(logging.INFO, logger="zerospeed"):
        log_dist("hello", ranks=[0])
        log_dist("not me", ranks=[1])
    assert logger.name == "zerospeed"
    assert [r.getMessage() for r in caplog.records] == ["[Rank 0] hello"]


@pytest.mark.parametrize("path,names", [
    ("zerospeed.utils", ["RepeatingLoader", "logger", "log_dist", "safe_get_full_fp32_param", "safe_get_full_grad",
                         "safe_set_full_fp32_param", "safe_get_full_optimizer_state"]),
    ("zerospeed.utils.logging", ["logger", "log_dist"]),
    ("zerospeed.ops.adam", ["DeepSpeedCPUAdam", "FusedAdam"]),
    ("zerospeed.ops.lamb", ["FusedLamb"]),
    ("zerospeed.runtime.lr_schedules", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]),
    ("zerospeed.comm", ["get_local_rank", "get_rank", "get_world_size"]),
    ("zerospeed.accelerator", ["get_accelerator"]),
])
def test_deepspeed_import_paths(path: str, names: list[str]) -> None:
    module = importlib.import_module(path)
    for name in names:
        assert hasattr(module, name), f"{path}.{name}"
