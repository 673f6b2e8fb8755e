"""zerospeed: DeepSpeed's training contract, rewritten small and trustworthy on PyTorch.

Public names load on first use, so the ``zerospeed`` command line starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _aliases

__version__ = "0.1.0"
__version_major__, __version_minor__, __version_patch__ = (int(part) for part in __version__.split("."))

_LAZY = {
    "initialize": ("zerospeed.runtime", "initialize"),
    "Engine": ("zerospeed.runtime", "Engine"),
    "DeepSpeedEngine": ("zerospeed.runtime", "Engine"),
    "init_distributed": ("zerospeed.runtime.distributed", "init_distributed"),
    "add_config_arguments": ("zerospeed.runtime.arguments", "add_config_arguments"),
    "init_inference": ("zerospeed.inference", "init_inference"),
    "InferenceEngine": ("zerospeed.inference", "InferenceEngine"),
    "ConfigError": ("zerospeed.config", "ConfigError"),
    "NotSupportedYetError": ("zerospeed.config", "NotSupportedYetError"),
    "zero": ("zerospeed.zero", None),
    "comm": ("zerospeed.comm", None),
    "checkpointing": ("zerospeed.checkpointing", None),
    "tp_model_init": ("zerospeed.parallel.tensor.model_init", "tp_model_init"),
    "get_accelerator": ("zerospeed.accelerator", "get_accelerator"),
    "OnDevice": ("zerospeed.compat.on_device", "OnDevice"),  # deepspeed.OnDevice
    "DeepSpeedConfigError": ("zerospeed.config", "ConfigError"),  # deepspeed.DeepSpeedConfigError
    "__git_hash__": ("zerospeed.compat.git_version_info", "git_hash"),  # DeepSpeed's build facts
    "__git_branch__": ("zerospeed.compat.git_version_info", "git_branch"),  # deepspeed.get_accelerator (DeepSpeed-Chat)
}

__all__ = ["__version__", *_LAZY]

_aliases.install()  # DeepSpeed import paths (zerospeed.pipe, zerospeed.runtime.pipe.schedule, ...)


def __getattr__(name: str) -> Any:
    if f"zerospeed.{name}" in _aliases.ALIASES:
        return importlib.import_module(f"zerospeed.{name}")
    if name not in _LAZY:
        raise AttributeError(f"module 'zerospeed' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
