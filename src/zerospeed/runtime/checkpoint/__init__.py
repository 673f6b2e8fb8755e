"""Checkpoints that never corrupt, reshard to any world size and stage, and never unpickle.

``save_checkpoint`` / ``load_checkpoint`` (what the engine's methods call), ``consolidate`` (one
safetensors file of the full model, without starting ranks), ``verify_checkpoint``. See ``layout`` for
the directory and commit protocol, ``universal`` for how state is addressed per parameter.
"""

from typing import Any

from .consolidate import consolidate, verify_checkpoint
from .deepspeed_convert import convert_deepspeed
from .errors import CheckpointError
from .load import load_checkpoint
from .save import save_checkpoint, writer_of


def wait_for_checkpoint(engine: Any) -> None:
    """Block until the engine's in-flight async save is committed; re-raise its error."""
    writer_of(engine).wait()


__all__ = ["CheckpointError", "consolidate", "convert_deepspeed", "load_checkpoint", "save_checkpoint", "verify_checkpoint",
           "wait_for_checkpoint"]
