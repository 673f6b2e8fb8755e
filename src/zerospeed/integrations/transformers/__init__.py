"""Hugging Face ``Trainer`` through zerospeed: ``ZeroSpeedTrainer(..., zerospeed_config=...)``.

Tested with transformers 5.x (``transformers>=5,<6``); the Trainer's internals it overrides are named in
``trainer.py``. Needs ``transformers`` (an optional extra)."""

from __future__ import annotations

from .auto import resolve as resolve_auto_config
from .pretrained import from_pretrained
from .trainer import ZeroSpeedTrainer

__all__ = ["ZeroSpeedTrainer", "from_pretrained", "resolve_auto_config"]
