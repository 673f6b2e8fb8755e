"""Rename-only import hook: ``import deepspeed[.x]`` resolves to ``zerospeed[.x]``, nothing else changes.

Used by ``scripts/deepspeed-conformance`` to run DeepSpeed's own unit tests against zerospeed. The hook
adds no names and patches no module: ``deepspeed.x`` *is* the module object ``zerospeed.x`` (same
identity, so ``isinstance`` and module state agree under either name). A DeepSpeed path zerospeed does
not serve fails exactly like a missing module, naming the DeepSpeed path. The pytest side (harness
patch, outcome recording) lives in :mod:`zerospeed.testing.ds_conformance_plugin`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

SOURCE = "deepspeed"
TARGET = "zerospeed"


def renamed(fullname: str) -> str | None:
    """``deepspeed.a.b`` -> ``zerospeed.a.b``; None for a name outside the ``deepspeed`` package."""
    if fullname == SOURCE or fullname.startswith(SOURCE + "."):
        return TARGET + fullname[len(SOURCE):]
    return None


class _SameModuleLoader(importlib.abc.Loader):
    """Hands the already-imported target module back under the DeepSpeed name."""

    def __init__(self, target: ModuleType) -> None:
        self.target = target
        self.spec = target.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.target

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system overwrote it with the alias spec; put ours back


class RenameFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder for the ``deepspeed`` namespace (install it first on ``sys.meta_path``)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        real_name = renamed(fullname)
        if real_name is None:
            return None
        try:
            real = importlib.import_module(real_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and renamed(fullname) is not None and exc.name.startswith(real_name):
                raise ModuleNotFoundError(f"No module named {fullname!r} (zerospeed does not serve "
                                          f"{real_name!r})", name=fullname) from None
            raise
        is_pkg = hasattr(real, "__path__")
        return importlib.machinery.ModuleSpec(fullname, _SameModuleLoader(real), is_package=is_pkg)


def install() -> None:
    """Put the rename finder first on ``sys.meta_path`` (idempotent); refuse if real DeepSpeed is loaded."""
    loaded = sys.modules.get(SOURCE)
    if loaded is not None and not loaded.__name__.startswith(TARGET):
        raise RuntimeError("the real deepspeed is already imported; the rename hook cannot take its place")
    if not any(isinstance(f, RenameFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, RenameFinder())


def uninstall() -> None:
    """Remove the finder and every ``deepspeed`` name it registered."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, RenameFinder)]
    for name in [n for n in sys.modules if renamed(n) is not None]:
        del sys.modules[name]
