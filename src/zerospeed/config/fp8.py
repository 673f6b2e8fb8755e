"""zerospeed only: ``fp8``, FP8 training of linear layers (DeepSpeed has no such key and ignores unknown
top-level keys, so a config carrying it still runs under DeepSpeed, in the model's own precision)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section

Fp8Backend = Literal["auto", "native", "emulated", "torchao", "transformer_engine"]


class Fp8Config(Section):
    """``{"enabled": true}``: every ``nn.Linear`` (except those named in ``skip_modules``) computes its three
    matmuls in FP8 with dynamic per-tensor scaling: inputs and weights in e4m3, output gradients in e5m2,
    fp32 accumulation, the master weights and optimizer unchanged.

    ``backend``: ``native`` runs ``torch._scaled_mm`` (CUDA with FP8 tensor cores, compute capability 8.9+;
    PyTorch's CPU kernel too, slowly); ``emulated`` quantises the same way and multiplies the dequantised
    values in fp32 (the numerics of ``native``; for tests and CPU); ``torchao`` converts with torchao's
    ``convert_to_float8_training`` (installed separately); ``auto`` is ``native`` on a GPU that has FP8 and an
    error elsewhere. ``skip_modules``: module names (or name suffixes after a dot) kept in their own
    precision; ``min_features``: linears with a dimension below it stay unconverted (FP8 GEMMs want
    multiples of 16). ``allgather_fp8``: under ZeRO-3 the weight all-gather moves e4m3 bytes with one fp32
    scale per block (a quarter of fp32's bytes); the gathered weights are dequantised copies.
    """

    enabled: bool = False
    backend: Fp8Backend = "auto"
    skip_modules: list[str] = Field(default_factory=lambda: ["lm_head"])
    min_features: int = Field(16, ge=1)
    allgather_fp8: bool = False
