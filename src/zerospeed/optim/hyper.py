"""One rule for every optimizer and scheduler hyper-parameter, applied to ``optimizer.params`` and
``scheduler.params`` before anything is built.

- Every number must be finite (``inf``, ``-inf`` and ``NaN`` are refused, in lists too, and as strings).
- Rates (``lr``, ``weight_decay``, every ``*_lr``, decay rates) are ``>= 0`` and at most ``MAX_RATE``: a larger
  one overflows the parameters within a step and is never meant.
- ``eps`` is ``> 0`` (it keeps a division finite); momentum-like coefficients (``momentum``, each of
  ``betas``, OneCycle's ``cycle_*_mom``) lie in ``[0, 1)``; ``dampening``, ``alpha``, ``rho`` and ratios in
  ``[0, 1]``.

A value that breaks the rule raises ``ConfigError`` naming its key (``optimizer.params.betas``, and the element of a list); the
typed sections (``optim/factory.py``, ``optim/schedules/factory.py``) then check types and unknown keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from zerospeed.config.errors import ConfigError

MAX_RATE = 1e6
_RATES = frozenset({"lr", "weight_decay", "lr_decay", "decay_lr_rate", "decay_mom_rate", "lr_range_test_step_rate",
                    "initial_accumulator_value", "max_coeff", "min_coeff"})
_POSITIVE = frozenset({"eps"})
_UNIT_OPEN = frozenset({"momentum", "betas", "cycle_min_mom", "cycle_max_mom"})
_UNIT_CLOSED = frozenset({"dampening", "alpha", "rho", "warmup_min_ratio", "cos_min_ratio", "coeff_beta"})


def _number(value: Any) -> float | None:
    """The value as a float when it is one (bools and non-numeric strings are left to the typed sections)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() != "auto":
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _check(name: str, key: str, value: float, item: str = "") -> None:
    if item:
        value_text = f"{item} = {value!r}"
        try:
            _check(name, key, value)
        except ConfigError as exc:
            raise ConfigError(key, str(exc).split(": ", 1)[1].replace(f"is {value!r}", f"has {value_text}", 1)) from None
        return
    if not math.isfinite(value):
        raise ConfigError(key, f"is {value!r}: a hyper-parameter must be a finite number")
    if name in _RATES or name.endswith("_lr"):
        if not 0 <= value <= MAX_RATE:
            raise ConfigError(key, f"is {value!r}: a rate must be greater than or equal to 0 and at most {MAX_RATE:g}")
    elif name in _POSITIVE:
        if not value > 0:
            raise ConfigError(key, f"is {value!r}: must be greater than 0 (it keeps the update's division finite)")
    elif name in _UNIT_OPEN:
        if not 0 <= value < 1:
            raise ConfigError(key, f"is {value!r}: must lie in [0, 1)")
    elif name in _UNIT_CLOSED and not 0 <= value <= 1:
        raise ConfigError(key, f"is {value!r}: must lie in [0, 1]")


def check_hyperparameters(params: Mapping[str, Any] | None, path: str) -> None:
    """Apply the rule above to every entry of ``params`` (lists element by element)."""
    for name, value in (params or {}).items():
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, item in items:
            number = _number(item)
            if number is not None:
                _check(str(name), f"{path}.{name}", number, "" if i is None else f"element [{i}]")
