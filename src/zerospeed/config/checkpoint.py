"""The ``checkpoint`` section (DeepSpeed names) plus zerospeed's ``async_save``.

Checkpoints are always stored "universally" (per parameter); ``load_universal`` allows loading the optimizer
state into another partitioning (world size or stage), refused without it as DeepSpeed refuses a
non-universal checkpoint. ``tag_validation``: what differing tags across ranks do (runtime/checkpoint/agree.py).
``use_node_local_storage`` (each node writing to its own disk) is not supported yet: every rank must see the
same directory.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import Section


class CheckpointWriterConfig(Section):
    """DeepSpeed's ``checkpoint.writer``: how each rank's tensor files are written (runtime/checkpoint/writer.py).

    ``python``: one write per tensor, hashed in line (zerospeed's writer without this section). ``fast``:
    the bytes go out in ``io_buffer_size`` pieces; a writer thread writes one piece while the next is hashed
    (and, from an accelerator, copied to the host), two in flight with ``io_buffer_double``, one without.
    ``decoupled``: the save returns after the snapshot and writes in the background (zerospeed's async
    save, the same atomic commit). ``show_statistics``: rank 0 logs each save's bytes, seconds and GB/s.
    """

    type: Literal["mock", "python", "fast"] = "fast"
    decoupled: bool = False
    io_buffer_size: int = 64 * 1024 ** 2
    io_buffer_double: bool = True
    show_statistics: bool = False
    data_parallel: Literal["replica", "socket", "machine"] | None = None
    io_multiplier: int = 1

    @field_validator("type", "data_parallel", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @field_validator("type")
    @classmethod
    def _no_mock(cls, v: str) -> str:
        if v == "mock":
            raise ValueError("\"mock\" (DeepSpeed's writer that discards the "
                                       "data) is not supported yet by zerospeed: a checkpoint it commits could not "
                                       "be loaded; use \"fast\" or \"python\"")
        return v

    @field_validator("io_buffer_size")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 4096:
            raise ValueError(f"must be at least 4096 bytes, got {v}")
        return v

    @field_validator("data_parallel")
    @classmethod
    def _replica(cls, v: str | None) -> str | None:
        if v in ("socket", "machine"):
            raise ValueError(f"{v!r} (one writer per {v}) is not "
                                       "supported yet by zerospeed; every data-parallel rank writes its own "
                                       "partition (\"replica\")")
        return v

    @field_validator("io_multiplier")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"{v} is not supported yet by zerospeed "
                                       "(DeepSpeed's aio queue depth multiplier); use 1")
        return v


class NebulaConfig(Section):
    """DeepSpeed's ``nebula`` section, served by zerospeed's own tiered checkpointing (runtime/checkpoint/tiered.py):
    each save is a snapshot in host memory first, then written and committed to the save directory in the
    background with the usual atomic commit; ``num_of_version_in_retention`` committed checkpoints are kept
    in the directory (older ones removed after each commit, never the one ``latest`` names)."""

    enabled: bool = False
    persistent_storage_path: str | None = None
    persistent_time_interval: int = 100
    num_of_version_in_retention: int = Field(2, ge=1)
    enable_nebula_load: bool = True
    nebula_load_path: str | None = None

    @field_validator("persistent_storage_path", "nebula_load_path")
    @classmethod
    def _no_service_path(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("a Nebula storage path is not supported yet by zerospeed: checkpoints are persisted to "
                             "(and loaded from) the directory given to save_checkpoint / load_checkpoint")
        return v

    @field_validator("persistent_time_interval")
    @classmethod
    def _every_save(cls, v: int) -> int:
        if v != 100:
            raise ValueError(f"{v} is not supported yet by zerospeed: every save is persisted as soon as it is "
                             "written (DeepSpeed's default 100 is accepted)")
        return v


class DataStatesConfig(Section):
    """DeepSpeed's ``datastates_ckpt`` section (on when present), served by zerospeed's tiered checkpointing:
    snapshot in host memory, then written and committed in the background. ``host_cache_size`` (GB): the
    host memory a snapshot may take; a save whose largest rank's state is bigger is written synchronously
    (from the state itself, no host copy), on every rank alike."""

    host_cache_size: float | None = Field(None, gt=0)


class ParallelWriteConfig(Section):
    """DeepSpeed's ``checkpoint.parallel_write``. ``pipeline_stage``: a pipeline's module tensors (frozen
    parameters, buffers) are written by their own stage, spread over the stage's data-parallel ranks, into
    each rank's shard file (``module/<name>``), instead of being gathered to rank 0's ``model_states``."""

    pipeline_stage: bool = False


class CheckpointConfig(Section):
    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    async_save: bool = False
    """zerospeed only: ``save_checkpoint`` returns after a CPU snapshot; files are written in the background."""
    writer: CheckpointWriterConfig | None = None
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: bool = True
    """DeepSpeed's torch.save zip format switch: zerospeed's own files are safetensors and JSON, so it decides
    the format of the few torch files written beside them (``runtime/checkpoint/torch_file.py``); DeepSpeed
    checkpoints in either format are read."""

    @property
    def background_writes(self) -> bool:
        """Whether a save returns after its snapshot: ``async_save``, or DeepSpeed's decoupled writer."""
        return self.async_save or (self.writer is not None and self.writer.decoupled)

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
