"""Runtime: initialize() wiring, the engine, the data loader."""

from .build import initialize
from .engine import Engine

__all__ = ["Engine", "initialize"]
