"""``deepspeed.runtime.config_utils``: ``DeepSpeedConfigModel``, the base class DeepSpeed's (and users') config
models derive from, over zerospeed's section base (``config/base.py``: unknown keys are errors).

DeepSpeed's two additions are kept: ``"auto"`` values are dropped unless ``strict=True`` (the field keeps its
default; the frameworks fill "auto" in), and a field marked ``json_schema_extra={"deprecated": True,
"new_param": "x", "new_param_fn": f}`` moves its value to ``x`` (through ``f``), after a warning; giving
both the old and the new name is an ``AssertionError``, as in DeepSpeed.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ConfigDict

from ..config.base import Section

_log = logging.getLogger("zerospeed.config")


class DeepSpeedConfigModel(Section):
    """A config model with DeepSpeed's "auto" and deprecated-field rules."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True,
                              validate_default=True, use_enum_values=True, arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:  # DeepSpeed: "auto" leaves the default in place (replace_method's "auto" is a value)
            data = {k: v for k, v in data.items() if not (v == "auto" and k != "replace_method")}
        super().__init__(**data)
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated") and name in self.model_fields_set:
                self._move_deprecated(name, extra)

    def _move_deprecated(self, name: str, extra: dict[str, Any]) -> None:
        new = str(extra.get("new_param", ""))
        message = f"Config parameter {name} is deprecated" + (f", use {new} instead" if new else "")
        _log.warning(message)
        if not new or not extra.get("set_new_param", True):
            return
        assert new not in self.model_fields_set, (
            f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new}' together")
        convert = extra.get("new_param_fn", lambda value: value)
        *parents, leaf = new.split(".")
        target: Any = self
        for part in parents:
            target = getattr(target, part)
        setattr(target, leaf, convert(getattr(self, name)))


def get_scalar_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """DeepSpeed's helper: ``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


__all__ = ["DeepSpeedConfigModel", "get_scalar_param"]
