"""The ``checkpoint`` section (DeepSpeed names) plus zerospeed's ``async_save``.

Checkpoints are always stored "universally" (per parameter); ``load_universal`` allows loading the optimizer
state into another partitioning (world size or stage), refused without it as DeepSpeed refuses a
non-universal checkpoint. ``tag_validation``: what differing tags across ranks do (runtime/checkpoint/agree.py).
``use_node_local_storage`` (each node writing to its own disk) is not supported yet: every rank must see the
same directory.
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from .base import Section


class CheckpointConfig(Section):
    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    async_save: bool = False
    """zerospeed only: ``save_checkpoint`` returns after a CPU snapshot; files are written in the background."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _case(cls, v: object) -> object:
        return str(v).capitalize() if isinstance(v, str) else v

    @field_validator("use_node_local_storage")
    @classmethod
    def _shared_only(cls, v: bool) -> bool:
        if v:
            raise ValueError("use_node_local_storage is not supported yet: all ranks must share the checkpoint directory")
        return v
