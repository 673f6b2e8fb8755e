"""``deepspeed.runtime.config``: ``DeepSpeedConfig(dict_or_path, mpu)`` over zerospeed's config loader.

The object is a view of one validated :class:`~zerospeed.config.ZeroSpeedConfig` with DeepSpeed's
attribute names; the batch triple is resolved for the data-parallel world (``mpu`` if given, else the
initialised process group, else 1) by zerospeed's own ``resolve_batch``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import ConfigError, ZeroSpeedConfig, load_config
from ..config.batch import resolve_batch
from .monitor_config import DeepSpeedMonitorConfig

DeepSpeedConfigError = ConfigError

# DeepSpeed's names of the config's optimizer ``type`` values (lower case, as it compares them)
ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER = "adagrad", "adam", "adamw", "lamb"
MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER = "muadam", "muadamw", "musgd"
LION_OPTIMIZER, MUON_OPTIMIZER = "lion", "muon"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, MUADAM_OPTIMIZER,
                        MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]
TORCH_ADAM_PARAM, ADAM_W_MODE, ADAM_W_MODE_DEFAULT = "torch_adam", "adam_w_mode", True


def _dp_world(mpu: Any) -> int:
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    from .. import comm

    return comm.get_world_size() if comm.is_initialized() else 1


class DeepSpeedConfig:
    """DeepSpeed's parsed-config object: ``train_batch_size``, ``zero_optimization_stage``, ... attributes."""

    def __init__(self, config: str | Path | dict[str, Any], mpu: Any = None, mesh_device: Any = None) -> None:
        self.config: ZeroSpeedConfig = load_config(config)
        self._param_dict = self.config.to_dict()
        self.world_size = _dp_world(mpu)
        batch = self.config.batch(self.world_size)
        self.train_batch_size = batch.train_batch_size
        self.train_micro_batch_size_per_gpu = batch.micro_batch_per_gpu
        self.gradient_accumulation_steps = batch.gradient_accumulation_steps
        zero = self.config.zero_optimization
        self.zero_config = zero
        self.zero_optimization_stage = self.config.zero_stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.fp16_enabled = self.config.fp16.enabled
        self.bfloat16_enabled = self.config.bf16.enabled
        self.float16_config = self.config.fp16
        self.bfloat16_config = self.config.bf16
        self.gradient_clipping = self.config.gradient_clipping
        self.steps_per_print = self.config.steps_per_print
        c = self.config
        self.monitor_config = DeepSpeedMonitorConfig(tensorboard=c.tensorboard, wandb=c.wandb,
                                                     csv_monitor=c.csv_monitor, comet=c.comet)

    def _configure_train_batch_size(self) -> None:
        """Fill in the batch triple from the ones set (DeepSpeed's method; tests and scripts call it after
        assigning the attributes) with zerospeed's ``resolve_batch``; an inconsistent triple is an
        ``AssertionError`` carrying zerospeed's message, as DeepSpeed asserts."""
        try:
            batch = resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                  self.gradient_accumulation_steps, self.world_size)
        except ConfigError as exc:
            raise AssertionError(str(exc)) from None
        self.train_batch_size = batch.train_batch_size
        self.train_micro_batch_size_per_gpu = batch.micro_batch_per_gpu
        self.gradient_accumulation_steps = batch.gradient_accumulation_steps

    def __getattr__(self, name: str) -> Any:  # the config's own sections, e.g. .optimizer, .scheduler
        if name.startswith("_") or name == "config":
            raise AttributeError(name)
        return getattr(self.config, name)


__all__ = ["ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "ADAM_W_MODE", "ADAM_W_MODE_DEFAULT",
           "DEEPSPEED_OPTIMIZERS", "DeepSpeedConfig", "DeepSpeedConfigError", "LAMB_OPTIMIZER", "LION_OPTIMIZER",
           "MUADAMW_OPTIMIZER", "MUADAM_OPTIMIZER", "MUON_OPTIMIZER", "MUSGD_OPTIMIZER", "TORCH_ADAM_PARAM"]
