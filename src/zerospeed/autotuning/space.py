"""Tuning spaces and experiment names, as DeepSpeed's autotuner defines them.

A space is a config fragment whose list values are the choices; ``expand`` makes every combination.
``canonical_name`` builds DeepSpeed's experiment names from the acronyms of the tuned keys
(``z2_gas1_tmbspg4``-style: ``train_micro_batch_size_per_gpu`` -> ``tmbspg``).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"

DEFAULT_TUNING_SPACE: dict[int, dict[str, Any]] = {
    0: {"zero_optimization": {"stage": 0}},
    1: {"zero_optimization": {"stage": 1, "reduce_bucket_size": [5e7, 5e8, 1e9],
                              "allgather_bucket_size": [5e7, 5e8, 1e9]}},
    2: {"zero_optimization": {"stage": 2, "overlap_comm": [True, False], "reduce_scatter": [False, True],
                              "reduce_bucket_size": [5e7, 5e8, 1e9], "allgather_bucket_size": [5e7, 5e8, 1e9],
                              "contiguous_gradients": [False, True]}},
    3: {"zero_optimization": {"stage": 3, "overlap_comm": [True, False], "reduce_scatter": [False, True],
                              "reduce_bucket_size": [5e7, 5e8, 1e9], "allgather_partitions": [True, False],
                              "allgather_bucket_size": [5e7, 5e8, 1e9], "contiguous_gradients": [False, True]}},
}


def _leaves(node: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], list[Any]]]:
    out = []
    for key, value in node.items():
        if isinstance(value, dict):
            out += _leaves(value, (*prefix, key))
        elif isinstance(value, list):
            out.append(((*prefix, key), value))
    return out


def _set(node: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = int(value) if isinstance(value, float) and value.is_integer() and value > 1 else value


def expand(space: dict[str, Any]) -> list[dict[str, Any]]:
    """Every combination of the list-valued keys of ``space`` (the other keys copied as they are)."""
    leaves = _leaves(space)
    if not leaves:
        return [copy.deepcopy(space)]
    out = []
    for values in itertools.product(*(choices for _, choices in leaves)):
        cfg = copy.deepcopy(space)
        for (path, _), value in zip(leaves, values):
            _set(cfg, path, value)
        out.append(cfg)
    return out


def tuning_keys(space: dict[str, Any]) -> list[str]:
    return sorted({path[-1] for path, _ in _leaves(space)} | {MICRO, GAS})


def _acronym(key: str) -> str:
    return "".join(part[0] for part in key.split("_") if part)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "T" if value else "F"
    if isinstance(value, (int, float)) and value > 9000:
        return f"{value:.1e}"
    return str(value)


def canonical_name(config: dict[str, Any], keys: list[str], prefix: str = "") -> str:
    """DeepSpeed's experiment name: ``prefix`` + ``<acronym><value>_`` for each tuned key found in ``config``."""
    def walk(node: dict[str, Any]) -> str:
        name = ""
        for key, value in node.items():
            if key == "arg_mappings":
                continue
            if isinstance(value, dict):
                inner = walk(value)
                name += inner + "_" if inner else ""
                continue
            if key in keys:
                name += f"{_acronym(key)}{_value(value)}_"
        return name

    return (prefix + walk(config)).rstrip("_").replace("__", "_")
