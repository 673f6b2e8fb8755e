"""``deepspeed.compression.helper``'s attribute-path helpers (DeepSpeed-Chat's LoRA module imports them)."""

from __future__ import annotations

from typing import Any


def recursive_getattr(model: Any, module_name: str) -> Any:
    """``model.a.b.c`` for ``"a.b.c"``."""
    out = model
    for name in module_name.split("."):
        out = getattr(out, name)
    return out


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``"a.b.c"``."""
    *parents, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(parents)) if parents else model, last, module)


__all__ = ["recursive_getattr", "recursive_setattr"]
