"""``deepspeed.OnDevice``: build a module's tensors on a device (``"meta"``: no memory) and in a dtype.

torch's own device context (``with torch.device(d)``) places every factory call; floating tensors are made
in ``dtype`` through torch's default dtype for the duration. zerospeed's ``zero.Init`` does the partitioned
variant; this is the plain one DeepSpeed offers beside it.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch


class OnDevice:
    """``with OnDevice(dtype=torch.half, device="meta"): model = Model()``; ``enabled=False`` does nothing."""

    def __init__(self, dtype: torch.dtype | None, device: Any = "meta", enabled: bool = True) -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self.enabled = enabled
        self._saved_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if not self.enabled:
            return self
        self.device.__enter__()
        if self.dtype is not None:
            self._saved_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        if self._saved_dtype is not None:
            torch.set_default_dtype(self._saved_dtype)
            self._saved_dtype = None
        self.device.__exit__(kind, exc, tb)


__all__ = ["OnDevice"]
