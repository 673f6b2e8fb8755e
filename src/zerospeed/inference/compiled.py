"""Fused regions: ``torch.compile`` a pure function, and fall back to eager if compiling or running it fails.

The decode loop is cut into regions that hold no cache state (see ``adapters``): *norm + QKV projection
(+ rotary)* before attention, *output projection + residual + norm + MLP + residual* after it, and *final
norm + LM head*. Each region is compiled for the first token count it sees and once more with a dynamic
count when another comes (PyTorch's automatic dynamic shapes; ``dynamic=True`` would re-patch the config on
every call). Inductor fuses the norms, activations and residual adds into a few kernels; matmuls stay on the
BLAS/cuBLAS path. With PyTorch's inlining of built-in modules the same graph serves every layer.
Attention itself runs PyTorch's fused
``scaled_dot_product_attention`` over the paged cache, outside the compiled regions.

A region is pure, so when the compiled call raises (no C++ compiler, an unsupported op, a backend error)
the region warns once, switches to eager for good, and reruns the call eagerly: outputs never depend on
whether compilation worked, only speed does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CompiledRegion", "default_backend"]


def default_backend() -> str:
    """``inductor``: PyTorch's own compiler, for CPU (C++/OpenMP) and CUDA (Triton)."""
    return "inductor"


class CompiledRegion:
    """``fn`` compiled by ``torch.compile(backend, dynamic=...)``; eager ``fn`` after the first failure."""

    def __init__(self, fn: Callable[..., Any], name: str, backend: str | Callable[..., Any] | None = None,
                 options: dict[str, Any] | None = None, dynamic: bool | None = None) -> None:
        self.fn = fn
        self.name = name
        opts = dict(options or {})
        opts.setdefault("dynamic", dynamic)
        self.compiled = torch.compile(fn, backend=backend or default_backend(), **opts)
        self.error: BaseException | None = None

    @property
    def active(self) -> bool:
        """True while the compiled path is in use (no failure seen)."""
        return self.error is None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.error is None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as exc:  # any compile/backend failure: the eager path gives the same result
                self.error = exc
                warnings.warn(f"torch.compile of the {self.name} region failed ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); running it eagerly from now on",
                              RuntimeWarning, stacklevel=2)
        return self.fn(*args, **kwargs)
