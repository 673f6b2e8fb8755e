"""A layer's weight-quantization state: fixed bits in the forward, or MoQ's falling bits.

``quantize_weight_in_forward: true``: the forward fake-quantizes the weight at ``target_bits`` (DeepSpeed's
``SymQuantizer``/``AsymQuantizer``, ternary at 2 bits, binary at 1). ``false`` (MoQ, DeepSpeed's
``runtime/quantize.py``): the bits start at ``start_bits`` and fall by one each time the quantizer's step
count reaches ``period``, which then doubles (times the eigenvalue factor); with ``fp16_mixed_quantize`` the
forward's weight is ``r w + (1 - r) Q(w)``. DeepSpeed overwrote the fp16 weights with ``Q(w)`` after each
optimizer step; here the forward computes ``Q(w)`` from the weight the optimizer left (the same value, with a
straight-through gradient to the master), so it works at every ZeRO stage: stage 3 quantizes the gathered
weight and nothing quantized is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quantizers import QuantSpec, check_bits, fake_quant, quantize_value


@dataclass
class WeightQuant:
    """One layer's weight quantization (mutable: MoQ moves ``bits``, ``period`` and ``ratio``)."""

    start_bits: int
    target_bits: int
    period: int
    in_forward: bool
    symmetric: bool = True
    groups: int = 1
    stochastic: bool = False
    mixed: bool = False
    bits: int = 0  # the current precision (MoQ); 0: start_bits
    ratio: float = 1.0  # MoQ fp16-mixed: weight of the unquantized value
    started: bool = False  # MoQ: the quantizer has run once (DeepSpeed quantized after the step that enabled it)

    def __post_init__(self) -> None:
        if self.bits == 0:
            self.bits = self.target_bits if self.in_forward else self.start_bits
        check_bits(self.target_bits, self.symmetric, "weight_quantization")

    def spec(self, bits: int | None = None, groups: int | None = None) -> QuantSpec:
        return QuantSpec(self.bits if bits is None else bits, self.symmetric, groups or self.groups,
                         self.stochastic)

    def apply(self, weight: torch.Tensor, groups: int | None = None) -> torch.Tensor:
        """The weight the forward uses (straight-through gradient to ``weight``)."""
        if self.in_forward:
            return fake_quant(weight, self.spec(self.target_bits, groups))
        if not self.started:
            return weight
        with torch.no_grad():
            q = quantize_value(weight.detach(), self.spec(groups=groups))
            if self.mixed:
                q = self.ratio * weight.detach() + (1 - self.ratio) * q
        return weight + (q - weight).detach()

    def baked(self, weight: torch.Tensor, groups: int | None = None) -> torch.Tensor:
        """The quantized value to store (``redundancy_clean``)."""
        with torch.no_grad():
            return self.apply(weight.detach(), groups).detach()
