"""The DeepSpeed config a Lightning strategy trains with: the user's, or one built from the strategy's
keyword arguments (Lightning's ``DeepSpeedStrategy`` names), completed from the Trainer's flags."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV_CONFIG = "PL_DEEPSPEED_CONFIG_PATH"  # Lightning's variable for a config path, honoured as by DeepSpeedStrategy


def load(config: str | Path | dict[str, Any] | None) -> dict[str, Any] | None:
    if config is None and ENV_CONFIG in os.environ:
        config = os.environ[ENV_CONFIG]
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"the zerospeed/DeepSpeed config {path} does not exist")
        return json.loads(path.read_text())
    return None if config is None else dict(config)


def default(stage: int, offload_optimizer: bool, offload_parameters: bool, offload_optimizer_device: str,
            offload_params_device: str, nvme_path: str, logging_batch_size_per_gpu: int | str,
            zero_allow_untested_optimizer: bool, zero_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Lightning's default config for ``stage`` (its strategy names: ``zerospeed_stage_2_offload`` ...)."""
    zero: dict[str, Any] = {"stage": stage, **zero_kwargs}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": offload_optimizer_device, "nvme_path": nvme_path}
    if offload_parameters:
        zero["offload_param"] = {"device": offload_params_device, "nvme_path": nvme_path}
    cfg: dict[str, Any] = {"zero_allow_untested_optimizer": zero_allow_untested_optimizer, "zero_optimization": zero}
    if logging_batch_size_per_gpu != "auto":
        cfg["train_micro_batch_size_per_gpu"] = logging_batch_size_per_gpu
    return cfg


def complete(config: dict[str, Any], accumulate_grad_batches: int, batch_size: int | None,
             gradient_clip_val: float | None, precision: str, fp16_options: dict[str, Any]) -> None:
    """Fill in what the Trainer decides: accumulation, micro-batch size, clipping, precision (in place)."""
    if "gradient_accumulation_steps" in config and config["gradient_accumulation_steps"] != accumulate_grad_batches:
        raise ValueError("do not set gradient_accumulation_steps in the config: it comes from "
                         f"Trainer(accumulate_grad_batches={accumulate_grad_batches})")
    config["gradient_accumulation_steps"] = accumulate_grad_batches
    config.pop("train_batch_size", None)
    if "train_micro_batch_size_per_gpu" not in config:
        config["train_micro_batch_size_per_gpu"] = batch_size or 1
    config.setdefault("gradient_clipping", float(gradient_clip_val or 0.0))
    if precision in ("16-mixed", "16-true") and "fp16" not in config:
        config["fp16"] = {"enabled": True, **fp16_options}
    elif precision in ("bf16-mixed", "bf16-true") and "bf16" not in config:
        config["bf16"] = {"enabled": True}
    elif precision not in ("32-true", "32", "16-mixed", "16-true", "bf16-mixed", "bf16-true"):
        raise ValueError(f"Trainer(precision={precision!r}) is not supported with zerospeed: use 32-true, "
                         "16-mixed or bf16-mixed")
