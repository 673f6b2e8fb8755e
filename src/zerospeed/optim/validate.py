"""Checks shared by the optimizer and scheduler builders: 'auto' left over, required keys, typed params.

Each builder receives one config section (``optimizer.params`` or ``scheduler.params``) and turns it into a
typed :class:`~zerospeed.config.base.Section`, so every user error names its full key path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from zerospeed.config.base import Section
from zerospeed.config.errors import ConfigError

S = TypeVar("S", bound=Section)


def reject_auto(params: Mapping[str, Any], path: str) -> None:
    """Raise if a value is still the string "auto" (the engine resolves what it can before building)."""
    for key, value in params.items():
        if isinstance(value, str) and value.strip().lower() == "auto":
            raise ConfigError(
                f"{path}.{key}",
                "is still 'auto': zerospeed could not derive it from the rest of the config; set a number",
            )


def parse_params(model: type[S], params: Mapping[str, Any] | None, path: str) -> S:
    """Validate ``params`` as ``model``: no 'auto', required keys present, unknown keys with did-you-mean."""
    data = dict(params or {})
    reject_auto(data, path)
    for name, field in model.model_fields.items():
        if field.is_required() and name not in data and (field.alias is None or field.alias not in data):
            raise ConfigError(f"{path}.{name}", "is required")
    return model.parse_section(data, path)


def per_group(value: float | list[float] | tuple[float, ...], n_groups: int, key: str) -> list[float]:
    """One value per parameter group: a scalar is repeated, a list must have one entry per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ConfigError(key, f"expected {n_groups} values (one per parameter group), got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * n_groups
