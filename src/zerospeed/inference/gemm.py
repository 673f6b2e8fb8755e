"""fp32 linears of the serving forward through oneDNN on x86 CPUs, where that is faster than PyTorch's default.

PyTorch runs an fp32 ``F.linear`` on CPU through MKL's sgemm, which uses AVX2 kernels on AMD CPUs (measured
on an AMD EPYC (Zen 5): ~100 GFLOP/s on one core for the serving benchmark's shapes). oneDNN, the library
behind PyTorch's ``mkldnn`` ops (``torch.ops.mkldnn._linear_pointwise``, which inductor uses for its CPU
linears), JIT-compiles AVX-512 kernels for the CPU at hand: ~200 GFLOP/s there, with a fixed cost of ~12 us
per call. So a linear takes oneDNN when it has at least ``MIN_MACS`` multiply-adds (16 rows of a 128 x 688
matmul, 64 rows of 128 x 128) and stays on ``F.linear`` below. oneDNN builds (JITs) one kernel per shape
(~0.4 ms each, then cached, 1024 kept): the row count is padded to a multiple of ``ROWS`` so a serving
workload, whose token count changes every forward, needs at most ``budget / ROWS`` kernels per matrix.
``linear_add`` also folds a residual add into the matmul (oneDNN's binary post-op).
Anything else (another dtype or device, a non-x86 CPU, ``torch.backends.mkldnn`` disabled or missing, a
non-contiguous operand) runs ``F.linear``.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

__all__ = ["MIN_MACS", "ROWS", "linear", "linear_add"]

MIN_MACS = 5 << 18  # ~1.3 M multiply-adds: where oneDNN's fixed cost is paid back (measured, see docstring)
ROWS = 8
_X86 = platform.machine().lower() in ("x86_64", "amd64")
_AVAILABLE = _X86 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_F32 = torch.float32


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_AVAILABLE and x.dtype is _F32 and weight.dtype is _F32 and x.dim() == 2 and not x.is_cuda
            and x.shape[0] * weight.shape[0] * weight.shape[1] >= MIN_MACS and x.device.type == "cpu"
            and x.is_contiguous() and weight.is_contiguous() and torch._C._get_mkldnn_enabled())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-d ``x``, through oneDNN when that pays (see module docstring)."""
    if not _onednn(x, weight):
        return F.linear(x, weight, bias)
    m = x.shape[0]
    pad = -m % ROWS
    y = torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, pad)) if pad else x, weight, bias, "none", [], "")
    return y[:m] if pad else y


def linear_add(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
    """``residual + F.linear(x, weight, bias)``, the add inside oneDNN's matmul when it runs there."""
    if not _onednn(x, weight) or x.shape[0] % ROWS or not residual.is_contiguous():
        return residual + linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
