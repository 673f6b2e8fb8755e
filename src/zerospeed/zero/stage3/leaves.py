"""ZeRO-3 leaf modules: a module whose whole subtree is gathered as one unit, with no hooks inside it.

A module flagged as a *leaf* (DeepSpeed's ``_z3_leaf`` flag on the module, set by
:func:`set_z3_leaf_modules` or by ``zero_optimization.leaf_module``) owns every partitioned parameter
below it: entering its forward gathers them all in one all-gather, and its children get no hooks. This
is what an MoE block needs: the experts a batch routes to differ per rank and per step, so per-expert
gathers would pair different collectives across ranks (a hang, or a ``RanksDivergedError``); gathering
the block whole keeps every rank's gathers the same. It also saves the hook and collective overhead of
very fine-grained modules.

``stage3_module_granularity_threshold`` picks leaves automatically with DeepSpeed's rule
(:func:`granularity_leaves`): a module's granularity is its parameter count divided by the number of
modules below it that have parameters (torch leaves count one each, the module itself one more;
containers such as ``ModuleList`` are never leaves and add nothing), or "infinite" past 1e9 parameters;
walking from the root, the first module on each path whose granularity is at most the threshold
becomes a leaf.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Sequence

from torch import nn

from ...config.leaf_module import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig
from .param_store import shard_of

_log = logging.getLogger("zerospeed.zero")

_FLAG = "_z3_leaf"  # DeepSpeed's attribute name: code that sets it by hand keeps working
_CONTAINERS = ("Container", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict")
_MAX_LEAF_NUMEL = 10**9  # DeepSpeed's Z3_MAX_LEAF_SIZE: a leaf this large would keep too much gathered
INFINITE = sys.maxsize


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is flagged as a ZeRO-3 leaf module."""
    return bool(getattr(model, _FLAG, False))


def z3_leaf_parameter(param: nn.Parameter, model: nn.Module | None = None) -> bool:
    """Whether ``param`` belongs to a leaf module of ``model``. DeepSpeed marks the parameter itself and takes
    the parameter alone; zerospeed keeps no attributes on parameters, so it needs the model too."""
    if model is None:
        raise TypeError("z3_leaf_parameter(param, model): zerospeed keeps no marks on parameters; pass the model "
                        "whose leaf modules to look in")
    return any(param is p for m in get_z3_leaf_modules(model) for p in m.parameters())


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` flagged as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    setattr(model, _FLAG, flag)


def _class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: nn.Module, classes: Sequence[type | str]) -> bool:
    for c in classes:
        if isinstance(c, type) and isinstance(module, c):
            return True
        if isinstance(c, str) and c in (type(module).__name__, _class_name(module)):
            return True
    return False


def _flag_classes(model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf_module_classes must be a list of classes or class names, got {classes!r}")
    found = [m for m in model.modules() if _matches(m, classes)]
    for m in found:
        set_z3_leaf_module(m, flag)
    if not found and raise_if_not_found:
        raise ValueError(f"no modules of type {list(classes)} found in the model ({type(model).__name__})")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of ``model`` that is an instance of (or whose class name, short or fully
    qualified, is) one of ``leaf_module_classes`` as a ZeRO-3 leaf; return them."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Clear the leaf flag of the matching modules (their children get hooks again)."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Iterable[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules named (as in ``named_modules()``); return them and the names not found."""
    by_name = dict(model.named_modules())
    found, missing = [], []
    for name in module_names:
        if name in by_name:
            set_z3_leaf_module(by_name[name], flag)
            found.append(by_name[name])
        else:
            missing.append(name)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing} found in the model ({type(model).__name__})")
    return found, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Iterable[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose ``named_modules()`` name ends with one of the suffixes."""
    found: dict[int, nn.Module] = {}
    missing = []
    named = list(model.named_modules())
    for suffix in module_name_suffixes:
        hits = [m for name, m in named if name.endswith(suffix)]
        for m in hits:
            set_z3_leaf_module(m, flag)
            found.setdefault(id(m), m)
        if not hits:
            missing.append(suffix)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules matching suffixes {missing} found in the model ({type(model).__name__})")
    return list(found.values()), missing


def apply_leaf_rules(model: nn.Module, rules: LeafModuleConfig) -> list[nn.Module]:
    """Flag the leaves ``rules`` name (DeepSpeed's ``apply_zero_leaf_module_config``); warn about names and
    suffixes the user gave that match nothing. Return the modules flagged."""
    out: dict[int, nn.Module] = {}
    for m in _flag_classes(model, rules.classes, True, raise_if_not_found=False):
        out.setdefault(id(m), m)
    found, missing = set_z3_leaf_modules_by_name(model, rules.names, raise_if_not_found=False)
    out.update((id(m), m) for m in found)
    if missing:
        _log.warning("zero_optimization.leaf_module.names: no modules named %s in the model", missing)
    found, missing = set_z3_leaf_modules_by_suffix(model, rules.name_suffixes, raise_if_not_found=False)
    out.update((id(m), m) for m in found)
    if missing:
        _log.warning("zero_optimization.leaf_module.name_suffixes: no module names end with %s", missing)
    customised = rules != LeafModuleConfig()
    if customised and not out:
        _log.warning("zero_optimization.leaf_module matched no modules: hooks are installed as usual")
    return list(out.values())


# --- stage3_module_granularity_threshold --------------------------------------------------------------
def _numel(p: nn.Parameter) -> int:
    """The full size, also of a parameter already cut by ``zero.Init`` (its data is then empty)."""
    shard = shard_of(p)
    return shard.numel if shard is not None else p.numel()


def granularities(model: nn.Module) -> dict[int, int]:
    """``id(module) -> granularity`` by DeepSpeed's rule (see the module docstring); INFINITE where a module
    cannot be a leaf (no parameters, a torch leaf, a container, or more than 1e9 parameters)."""
    out: dict[int, int] = {}

    def walk(m: nn.Module) -> tuple[int, int]:
        if next(m.parameters(), None) is None:
            out[id(m)] = INFINITE
            return 0, 0
        numel = sum(_numel(p) for p in m.parameters(recurse=False))
        children = list(m.children())
        if not children:
            out[id(m)] = INFINITE
            return 1, numel
        layers = 0
        for c in children:
            n_layers, n_params = walk(c)
            layers += n_layers
            numel += n_params
        if type(m).__name__ in _CONTAINERS:
            out[id(m)] = INFINITE
            return layers, numel
        layers += 1
        out[id(m)] = numel // layers if numel <= _MAX_LEAF_NUMEL else INFINITE
        return layers, numel

    walk(model)
    return out


def granularity_leaves(model: nn.Module, threshold: int) -> list[nn.Module]:
    """Flag and return the leaves ``stage3_module_granularity_threshold = threshold`` makes (none at 0)."""
    if threshold <= 0:
        return []
    gran = granularities(model)
    smallest = min(gran.values())
    if smallest > threshold:
        _log.warning("stage3_module_granularity_threshold %d makes no leaf: the smallest module granularity is %d "
                     "(set the threshold to at least that)", threshold, smallest)
        return []
    leaves: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if next(m.parameters(), None) is None:
            return
        if gran[id(m)] <= threshold:
            set_z3_leaf_module(m, True)
            leaves.append(m)
            return
        for c in m.children():
            visit(c)

    visit(model)
    return leaves


__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "apply_leaf_rules", "get_z3_leaf_modules", "granularities",
           "granularity_leaves", "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]
