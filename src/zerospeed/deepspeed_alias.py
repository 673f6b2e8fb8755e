"""``import deepspeed`` resolving to zerospeed, opt-in (``zerospeed alias install``; docs/migration.md step 1).

The alias is two things written into a site directory:

* a tiny ``deepspeed`` package whose ``__init__`` calls :func:`activate`: the ``deepspeed`` module forwards
  every attribute to ``zerospeed`` and carries DeepSpeed's version, and a finder first on ``sys.meta_path``
  answers every ``deepspeed.X`` with the module ``zerospeed.X`` itself (the real module, or the thin alias
  that ``_aliases.py`` serves for a DeepSpeed path), so ``isinstance`` checks and module state are shared;
* a ``deepspeed-<version>.dist-info`` so that ``importlib.metadata.version("deepspeed")`` answers, as
  transformers, Accelerate and Lightning check it before they take their DeepSpeed code path.

The version is DeepSpeed's that zerospeed follows, with zerospeed's own as a local label
(``0.19.8+zerospeed.0.1.0``). Install refuses when the real DeepSpeed is installed in that environment;
uninstall removes only files this module wrote (both carry a marker). Importing this file does not
import torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import shutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

DEEPSPEED_VERSION = "0.19.8"  # the DeepSpeed release whose behaviour zerospeed follows
MARKER = "zerospeed-alias"
_INIT = f'''"""Written by `zerospeed alias install` ({MARKER}): `import deepspeed` resolves to zerospeed.
Remove with `zerospeed alias uninstall`."""

from zerospeed.deepspeed_alias import activate as _activate

_activate(globals())
'''


def alias_version() -> str:
    import zerospeed

    return f"{DEEPSPEED_VERSION}+zerospeed.{zerospeed.__version__}"


# --- at import time: the deepspeed package ---------------------------------------------------------------
class _Loader(importlib.abc.Loader):
    def __init__(self, real: str) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return lazy_submodules(importlib.import_module(self.real))  # the zerospeed module: one object, two names

    def exec_module(self, module: ModuleType) -> None:
        return None


def lazy_submodules(module: Any) -> Any:
    """Let ``module.sub`` import the submodule on first use, as DeepSpeed's eager imports make
    ``deepspeed.runtime.lr_schedules`` reachable by attribute after ``import deepspeed`` (Accelerate does it)."""
    if not isinstance(module, ModuleType) or not hasattr(module, "__path__") or \
            getattr(module, "__zerospeed_lazy__", False):
        return module
    previous = module.__dict__.get("__getattr__")

    def __getattr__(name: str) -> Any:  # noqa: N807 - module attribute fallback
        if previous is not None:
            try:
                return previous(name)
            except AttributeError:
                pass
        if not name.startswith("__"):
            try:
                return lazy_submodules(importlib.import_module(f"{module.__name__}.{name}"))
            except ModuleNotFoundError as exc:
                if exc.name != f"{module.__name__}.{name}":
                    raise
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r} (served for deepspeed by "
                             "zerospeed alias: zerospeed does not have this DeepSpeed name yet)")

    module.__getattr__ = __getattr__
    module.__zerospeed_lazy__ = True
    return module


class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """``deepspeed.X`` -> ``zerospeed.X`` (None when zerospeed has no such module: a normal ImportError)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("deepspeed."):
            return None
        real = "zerospeed" + fullname[len("deepspeed"):]
        try:
            found = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(real), is_package=True)


def activate(namespace: dict[str, Any]) -> None:
    """Make the module whose globals are ``namespace`` (the ``deepspeed`` package) stand for zerospeed."""
    import zerospeed

    if not any(isinstance(f, DeepSpeedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedFinder())

    def __getattr__(name: str) -> Any:  # noqa: N807 - module attribute fallback
        try:
            return lazy_submodules(getattr(zerospeed, name))
        except AttributeError:
            return lazy_submodules(importlib.import_module(f"deepspeed.{name}"))  # a submodule, by the finder

    namespace["__getattr__"] = __getattr__
    namespace["__version__"] = alias_version()
    namespace["__all__"] = list(getattr(zerospeed, "__all__", []))
    namespace["__zerospeed_alias__"] = True


# --- install / uninstall ------------------------------------------------------------------------------
class AliasError(RuntimeError):
    """The alias cannot be installed or removed here; the message says why and what to do."""


def default_site_dir() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _ours(path: Path) -> bool:
    try:
        return MARKER in path.read_text(errors="replace")
    except OSError:
        return False


def _real_deepspeed(site: Path) -> str | None:
    """Where a real DeepSpeed lives (in ``site`` or on ``sys.path``), or None."""
    init = site / "deepspeed" / "__init__.py"
    if init.exists() and not _ours(init):
        return str(init.parent)
    try:
        dist = importlib.metadata.distribution("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None
    if MARKER in (dist.read_text("METADATA") or ""):
        return None
    return str(dist.locate_file(""))


def install(site: Path | None = None) -> list[Path]:
    """Write the ``deepspeed`` package and its dist-info into ``site``; returns the paths written."""
    site = default_site_dir() if site is None else Path(site)
    real = _real_deepspeed(site)
    if real is not None:
        raise AliasError(f"the real DeepSpeed is installed ({real}): `import deepspeed` already means DeepSpeed. "
                         "Uninstall it (pip uninstall deepspeed) to alias it to zerospeed, or use a separate "
                         "environment")
    uninstall(site)  # an older alias (another version) goes first
    package = site / "deepspeed"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(_INIT)
    info = site / f"deepspeed-{alias_version()}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {alias_version()}\n"
                                   f"Summary: {MARKER}: import deepspeed resolves to zerospeed\n")
    (info / "INSTALLER").write_text(f"{MARKER}\n")
    (info / "top_level.txt").write_text("deepspeed\n")
    (info / "RECORD").write_text("deepspeed/__init__.py,,\n" + "".join(
        f"{info.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "top_level.txt", "RECORD")))
    importlib.invalidate_caches()
    return [package, info]


def uninstall(site: Path | None = None) -> list[Path]:
    """Remove what :func:`install` wrote in ``site`` (nothing else); returns the paths removed."""
    site = default_site_dir() if site is None else Path(site)
    removed: list[Path] = []
    init = site / "deepspeed" / "__init__.py"
    if init.exists() and _ours(init):
        shutil.rmtree(init.parent)
        removed.append(init.parent)
    for info in site.glob("deepspeed-*.dist-info"):
        if _ours(info / "METADATA"):
            shutil.rmtree(info)
            removed.append(info)
    importlib.invalidate_caches()
    return removed
