"""The torch files written beside a zerospeed checkpoint (a framework's own state, such as the Hugging Face
Trainer's ``scheduler.pt``), in the format ``checkpoint.checkpoint_serialization`` names: torch's zip format
(true, DeepSpeed's default) or its legacy format (false, as DeepSpeed's ``torch.save(...,
_use_new_zipfile_serialization=False)``). Reading takes either (``torch.load(weights_only=True)``)."""

from __future__ import annotations

import os
from typing import Any

import torch


def save_torch(obj: Any, path: str | os.PathLike[str], checkpoint_serialization: bool = True) -> None:
    torch.save(obj, path, _use_new_zipfile_serialization=checkpoint_serialization)
