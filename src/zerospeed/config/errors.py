"""User-facing configuration errors: name the key, the value and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A DeepSpeed-style config is wrong; the message names the full key path."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"config key '{key}': {message}" if key else message)

    def __reduce__(self) -> tuple:
        """Pickle by state, not by ``__init__`` arguments: a worker process's config error reaches its parent."""
        return (_blank, (type(self), self.args), dict(self.__dict__))  # pickle sets the state itself


def _blank(cls: type[ConfigError], args: tuple) -> ConfigError:
    """An instance of ``cls`` with ``args`` and no ``__init__`` run (its attributes come from the pickle)."""
    err = ValueError.__new__(cls)
    err.args = args
    return err


class UnknownKeyError(ConfigError):
    """A key the schema does not have; ``loc`` is its path, ``hint`` the did-you-mean (or '')."""

    def __init__(self, key: str, loc: tuple[str, ...], hint: str) -> None:
        self.loc = loc
        self.hint = hint
        super().__init__(key, f"unknown key.{hint}")


class NotSupportedYetError(ConfigError):
    """A key DeepSpeed has but zerospeed does not implement yet."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ' Did you mean 'x'?' for the closest candidate, or ''."""
    matches = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return f" Did you mean '{matches[0]}'?" if matches else ""


def unknown_key_error(path: str, key: str, known: Iterable[str]) -> ConfigError:
    full = f"{path}.{key}" if path else key
    return ConfigError(full, f"unknown key.{did_you_mean(key, known)}")
