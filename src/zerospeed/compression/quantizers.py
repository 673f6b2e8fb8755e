"""Fake quantization (quantize, then dequantize) with DeepSpeed 0.19.6's formulas, and straight-through gradients.

A tensor is flattened and cut into ``groups`` equal groups; each group gets its own scale. With ``b`` bits and
``q = 2^b``:

* symmetric:  ``s = 2 max|x| / q``; ``x -> clamp(round(x / s), -q/2, q/2 - 1) * s``
* asymmetric: ``s = (max x - min x) / q``; ``z = round(min x / s) * s``; ``x -> clamp(round((x - z) / s), 0, q - 1) * s + z``
* ternary (2 bits): ``t = 0.7 mean|x|``; ``x -> a sign(x)`` where ``|x| > t`` (``a`` = the mean ``|x|`` there), else 0
* binary (1 bit): ``x -> mean|x| sign(x)``

(``min``/``max`` may be given instead: static activation ranges, one group.) Stochastic rounding adds uniform
noise in ``[-0.5, 0.5)`` before rounding. ``fake_quant`` returns the quantized value in the forward and passes
the gradient through unchanged (DeepSpeed's ``SymQuantizer`` & co. backward). The integer codes and scales of
the same formulas (``codes_and_scales``) are what ``export`` hands to the inference engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantSpec:
    """How to fake-quantize: bits, symmetric or not, groups over the flattened tensor, rounding."""

    bits: int
    symmetric: bool = True
    groups: int = 1
    stochastic: bool = False


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    if x.numel() % groups:
        raise ValueError(f"a tensor of {x.numel()} elements cannot be cut into {groups} quantization groups")
    return x.reshape(groups, -1)


def _round(x: torch.Tensor, stochastic: bool) -> torch.Tensor:
    if stochastic:
        x = x + torch.empty_like(x).uniform_(-0.5, 0.5)
    return x.round()


def codes_and_scales(x: torch.Tensor, spec: QuantSpec, lo: torch.Tensor | None = None,
                     hi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes [groups, n], scale [groups, 1], zero point [groups, 1] or None)``, with ``x ~ codes * s + z``."""
    q = 2**spec.bits
    g = _grouped(x, spec.groups if lo is None else 1)
    if spec.symmetric:
        top = g.abs().amax(-1, keepdim=True) if lo is None else torch.max(lo.abs(), hi).reshape(1, 1)  # type: ignore[arg-type]
        scale = 2 * top / q
        codes = _round(g / scale, spec.stochastic).clamp(-q // 2, q // 2 - 1)
        return codes, scale, None
    if lo is None:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo) / q
    zero = (lo / scale).round() * scale
    codes = _round((g - zero) / scale, spec.stochastic).clamp(0, q - 1)
    return codes, scale, zero


def ternary(x: torch.Tensor, groups: int) -> torch.Tensor:
    g = _grouped(x, groups)
    thres = 0.7 * g.abs().mean(-1, keepdim=True)
    kept = (g.abs() > thres).to(g.dtype)
    alpha = (kept * g).abs().sum(-1, keepdim=True) / kept.sum(-1, keepdim=True)
    return (alpha * ((g > thres).to(g.dtype) - (g < -thres).to(g.dtype))).reshape(x.shape)


def binary(x: torch.Tensor, groups: int) -> torch.Tensor:
    g = _grouped(x, groups)
    return (g.sign() * g.abs().mean(-1, keepdim=True)).reshape(x.shape)


def quantize_value(x: torch.Tensor, spec: QuantSpec, lo: torch.Tensor | None = None,
                   hi: torch.Tensor | None = None) -> torch.Tensor:
    """The fake-quantized value of ``x`` (no gradient rule; see ``fake_quant``)."""
    if spec.bits == 2 and lo is None:
        return ternary(x, spec.groups)
    if spec.bits == 1 and lo is None:
        return binary(x, spec.groups)
    codes, scale, zero = codes_and_scales(x, spec, lo, hi)
    out = codes * scale if zero is None else codes * scale + zero
    return out.reshape(x.shape)


def fake_quant(x: torch.Tensor, spec: QuantSpec, lo: torch.Tensor | None = None,
               hi: torch.Tensor | None = None) -> torch.Tensor:
    """``quantize_value`` in the forward, the identity in the backward (straight-through estimator)."""
    with torch.no_grad():
        q = quantize_value(x.detach(), spec, lo, hi)
    return x + (q - x).detach()


def check_bits(bits: int, symmetric: bool, where: str) -> None:
    """Ternary and binary weights are symmetric only (as in DeepSpeed)."""
    if bits <= 2 and not symmetric:
        raise ValueError(f"{where}: {bits}-bit weight quantization is symmetric only (quantization_type "
                         "'asymmetric' needs 3 bits or more)")
