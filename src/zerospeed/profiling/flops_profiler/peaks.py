"""Peak dense throughput of known accelerators, for model FLOPs utilization (MFU = achieved / peak).

Figures are the vendors' dense (no sparsity) bf16/fp16 tensor-core peaks in FLOP/s. Names are matched as
case-insensitive substrings of the device name, most specific first. An unknown device (the CPU included)
has no peak, and MFU is reported as n/a rather than guessed.
"""

from __future__ import annotations

PEAK_FLOPS: list[tuple[str, float]] = [
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("V100", 125e12),
    ("T4", 65e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
]


def peak_flops(device_name: str) -> float | None:
    """Dense bf16/fp16 peak FLOP/s of ``device_name`` (e.g. ``'NVIDIA H200'``), or None when unknown."""
    lowered = device_name.lower()
    for key, peak in PEAK_FLOPS:
        if key.lower() in lowered:
            return peak
    return None


def mfu(achieved_flops_per_s: float, device_name: str) -> float | None:
    """Achieved / peak (a fraction), or None when the device's peak is unknown."""
    peak = peak_flops(device_name)
    if peak is None or achieved_flops_per_s <= 0:
        return None
    return achieved_flops_per_s / peak
