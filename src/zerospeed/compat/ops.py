"""``deepspeed.ops.__compatible_ops__``: op name -> whether zerospeed implements it (see op_builder)."""

from __future__ import annotations

from .op_builder import __compatible_ops__

__all__ = ["__compatible_ops__"]
