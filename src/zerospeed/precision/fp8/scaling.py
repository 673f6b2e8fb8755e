"""Dynamic per-tensor FP8 scaling: ``scale = fp8_max / amax``, ``q = fp8(clamp(x * scale))``, ``x ≈ q / scale``.

e4m3 (max 448) holds activations and weights; e5m2 (max 57344, two more exponent bits) holds output gradients,
whose range is wider. An all-zero tensor gets scale 1 (its codes are zero either way).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, inverse scale)`` of ``x`` with one scale for the whole tensor; ``codes.float() * inv ≈ x``."""
    amax = x.detach().abs().amax().float()
    scale = torch.where(amax > 0, fp8_max(dtype) / amax.clamp(min=EPS), torch.ones_like(amax))
    limit = fp8_max(dtype)
    codes = (x.float() * scale).clamp(-limit, limit).to(dtype)
    return codes, scale.reciprocal()


def from_fp8(codes: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.float() * inv_scale).to(dtype)
