"""HJSON config files, as DeepSpeed reads them (``hjson`` is a superset of JSON: comments, unquoted keys).

A file that is not valid JSON is read with ``hjson`` when it is installed (the ``deepspeed-compat``
extra); otherwise the error says how to get it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ConfigError


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for JSON and HJSON: a key written twice in one object is an error (as in
    DeepSpeed), never the last value silently winning."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ConfigError(key, "the key is written twice in the same object of the config file")
        data[key] = value
    return data


def read_hjson(path: Path, json_error: json.JSONDecodeError) -> Any:
    """The file's value read as HJSON; ConfigError naming the file when that fails or hjson is absent."""
    try:
        import hjson
    except ImportError:
        raise ConfigError("", f"config file {str(path)!r} is not valid JSON ({json_error}); if it is HJSON, "
                              "install the hjson package (pip install 'zerospeed[deepspeed-compat]')") from None
    try:
        return hjson.loads(path.read_text(), object_pairs_hook=no_duplicate_keys)
    except hjson.HjsonDecodeError as exc:
        raise ConfigError("", f"config file {str(path)!r} is not valid JSON ({json_error}), nor HJSON "
                              f"({exc})") from None
