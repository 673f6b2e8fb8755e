"""Human-readable numbers in DeepSpeed's style: ``1.23 G``, ``1.23 GMACs``, ``1.23 GFLOPS``, ``1.23 M``."""

from __future__ import annotations

DEFAULT_PRECISION = 2

_SCALES = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, ""), (1e-3, "m"), (1e-6, "u")]


def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """``1234567 -> '1.23 M'``; ``units`` forces one of T, G, M, K, '', m, u."""
    if units is None:
        magnitude, units = 1e-6, "u"
        for scale, name in _SCALES:
            if abs(num) >= scale or (num == 0 and scale == 1.0):
                magnitude, units = scale, name
                break
    else:
        magnitude = dict((name, scale) for scale, name in _SCALES).get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """A rate: ``'1.23 GFLOPS'``."""
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Parameter counts use B (billions) instead of G: ``'1.3 B'``, ``'125 M'``."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


def bytes_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(num, units, precision)}B"
