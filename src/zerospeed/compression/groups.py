"""Which modules each technique's groups name: DeepSpeed 0.19.6's ``modules`` / ``related_modules`` matching.

A pattern is a regular expression searched (``re.search``) in each compressible module's name (``"*"``:
every one). Within one technique a module may be matched by one group only (an error names it otherwise).
For each ``modules`` pattern, ``related_modules`` lists patterns whose matches pair, in order, with that
pattern's matches: the ``j``-th match of each related pattern follows the ``j``-th pruned module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config.compression_training import TECHNIQUES, CompressionTrainingConfig
from ..config.errors import ConfigError
from .replace import is_module_compressible


@dataclass(frozen=True)
class MatchedGroup:
    """One group of one technique: its modules (per pattern), related modules and merged parameters."""

    technique: str
    name: str
    modules: list[list[str]]
    related: list[list[list[str]]]  # per modules pattern: per related pattern: module names
    params: Any  # the group's ``params`` section (bits, dense ratio)
    shared: Any  # the technique's ``shared_parameters`` section

    def all_modules(self) -> list[str]:
        return [n for names in self.modules for n in names]


def get_module_name(group_name: str, model: nn.Module, key_word: str, exist_module_name: set[str],
                    mpu: Any = None, verbose: bool = True) -> tuple[list[str], set[str]]:
    """The compressible modules whose name matches ``key_word`` and are not in ``exist_module_name`` yet."""
    found = []
    for name, module in model.named_modules():
        if not name or not is_module_compressible(module, mpu):
            continue
        if key_word != "*" and re.search(key_word, name) is None:
            continue
        if name in exist_module_name:
            if verbose:
                raise ConfigError("compression_training", f"module '{name}' is already in another group of "
                                  f"the same technique (group '{group_name}', pattern {key_word!r})")
            continue
        exist_module_name.add(name)
        found.append(name)
    return found, exist_module_name


def match_groups(model: nn.Module, cfg: CompressionTrainingConfig, techniques: tuple[str, ...] = TECHNIQUES,
                 check_duplicates: bool = True) -> list[MatchedGroup]:
    """Every enabled technique's groups that match at least one module, in the config's order."""
    out = []
    for technique in techniques:
        section: Any = cfg.technique(technique)
        shared = section.shared_parameters
        if not shared.enabled:
            continue
        taken: set[str] = set()
        for gname, group in section.different_groups.items():
            modules = [get_module_name(gname, model, kw, taken, verbose=check_duplicates)[0] for kw in group.modules]
            related = []
            for rel_patterns in group.related_modules or []:
                related.append([get_module_name(gname, model, kw, set())[0] for kw in rel_patterns])
            if any(modules):
                out.append(MatchedGroup(technique, gname, modules, related, group.params, shared))
    return out
