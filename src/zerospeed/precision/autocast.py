"""``torch_autocast``: the engine's forward runs inside ``torch.autocast`` (DeepSpeed's ``autocast_if_enabled``).

The parameters keep the precision mode's dtype (fp32 without fp16/bf16); the ops autocast lists compute in the
region's dtype, and autograd returns each gradient in its parameter's dtype. Nesting follows DeepSpeed: an
autocast the caller opened around ``engine(x)`` is replaced by the engine's (its dtype wins) when
``torch_autocast`` is on, and switched off inside the engine's forward when it is off (the engine follows its
own precision sections), with one warning each. fp16 autocast scales the loss by ``torch.amp.GradScaler``'s
rule at its defaults, as DeepSpeed does (``precision/loss_scaler.py``: ``GradScalerRule``).

``lower_precision_safe_modules`` names the classes (exact classes, not subclasses) whose parameters' gradients
are reduced in the autocast dtype under ZeRO 1-3, as DeepSpeed marks them; :meth:`AutocastRegion.safe_parameters`
finds them and ``runtime/build_optimizer.py`` (``lower_precision_grads``) gives their buckets that dtype. The
other gradients are reduced in ``communication_data_type``; all accumulate in ``grad_accum_dtype``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ..config.precision import TorchAutocastConfig

_log = logging.getLogger("zerospeed.precision")

# DeepSpeed's LOWER_PRECISION_SAFE_MODULES.
DEFAULT_SAFE_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__name__}"


def import_classes(names: list[str], key: str) -> tuple[type, ...]:
    """``package.module.Class`` names -> classes; an unimportable one is a ConfigError naming ``key``."""
    from ..config import ConfigError

    out = []
    for name in names:
        package, _, cls_name = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(package), cls_name))
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(key, f"cannot import lower precision safe module {name!r} ({exc}); name each class "
                                   "as package.module.Class, e.g. torch.nn.modules.linear.Linear") from None
    return tuple(out)


@dataclass
class AutocastRegion:
    """The forward's autocast region. ``dtype`` None: the device's autocast default (bf16 on CPU)."""

    device_type: str
    enabled: bool
    dtype: torch.dtype | None = None
    safe_modules: tuple[type, ...] = DEFAULT_SAFE_MODULES
    _warned: bool = field(default=False, repr=False)

    @classmethod
    def from_config(cls, section: TorchAutocastConfig, device_type: str) -> AutocastRegion:
        """From the ``torch_autocast`` section; the module names are imported here (errors name the key)."""
        from ..config.data_types import DTYPE_NAMES

        enabled = section.enabled
        dtype = DTYPE_NAMES[section.dtype.lower()] if section.dtype is not None else None
        if enabled and dtype is None:
            dtype = torch.get_autocast_dtype(device_type)
        names = section.lower_precision_safe_modules
        safe = DEFAULT_SAFE_MODULES if names is None else import_classes(names, "torch_autocast.lower_precision_safe_modules")
        return cls(device_type, enabled, dtype, safe)

    @property
    def safe_module_names(self) -> list[str]:
        """DeepSpeed's ``engine.torch_autocast_lower_precision_safe_modules()``: the classes as dotted paths."""
        return [class_path(c) for c in self.safe_modules]

    def safe_parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """The parameters owned directly by modules whose class is exactly one of the safe classes."""
        return [p for m in module.modules() if type(m) in self.safe_modules for p in m.parameters(recurse=False)]

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            _log.warning(message)
            self._warned = True

    @contextmanager
    def region(self) -> Iterator[None]:
        """Enter for one forward: the engine's autocast, or none (an outer one switched off), as DeepSpeed."""
        outer = torch.is_autocast_enabled(self.device_type)
        if self.enabled:
            if outer:
                self._warn_once("torch.autocast is already enabled outside the engine: its forward follows the "
                                "torch_autocast section of the config instead")
            with torch.autocast(self.device_type, dtype=self.dtype, enabled=True):
                yield
        elif outer:
            self._warn_once("torch.autocast is enabled outside the engine but torch_autocast is off: the engine's "
                            "forward runs without autocast (its fp16/bf16 sections decide the precision), as in "
                            "DeepSpeed; set torch_autocast.enabled to use torch's autocast")
            with torch.autocast(self.device_type, enabled=False):
                yield
        else:
            yield
