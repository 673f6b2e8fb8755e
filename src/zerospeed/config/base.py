"""Base class of every config section: strict keys, DeepSpeed names, readable errors."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import ConfigError, UnknownKeyError, did_you_mean

S = TypeVar("S", bound="Section")


class Section(BaseModel):
    """A config section. Unknown keys are errors (with a did-you-mean), never ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    @classmethod
    def parse_section(cls: type[S], data: Any, path: str) -> S:
        """Validate ``data`` as this section; errors become ``ConfigError`` naming ``path``."""
        if isinstance(data, cls):
            return data
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(path, f"expected a JSON object, got {type(data).__name__} {data!r}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise translate_validation_error(exc, cls, path) from None


def known_keys(model: type[BaseModel]) -> set[str]:
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        keys.add(name)
        if field.alias:
            keys.add(field.alias)
    return keys


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """Walk the pydantic models along ``loc`` (for did-you-mean candidates)."""
    current: Any = model
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            for f in current.model_fields.values():
                if f.alias == part:
                    field = f
        if field is None:
            return None
        current = field.annotation
        args = getattr(current, "__args__", ())
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def translate_validation_error(exc: ValidationError, model: type[BaseModel], path: str) -> ConfigError:
    """Turn the first pydantic error into a ConfigError with the full key path."""
    err = exc.errors()[0]
    loc = tuple(p for p in err["loc"] if not isinstance(p, int) or True)
    str_loc = [str(p) for p in loc]
    key = ".".join([path, *str_loc]) if path else ".".join(str_loc)
    if err["type"] == "extra_forbidden":
        parent = _model_at(model, loc[:-1]) if len(loc) > 1 else model
        hint = did_you_mean(str(loc[-1]), known_keys(parent)) if parent else ""
        return UnknownKeyError(key, tuple(str_loc), hint)
    value = err.get("input")
    return ConfigError(key, f"{err['msg']} (got {value!r})")
