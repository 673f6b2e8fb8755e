"""``CheckpointPart``: one protocol for everything a checkpoint holds beyond the module's tensors.

Each part of an engine that has state to keep (the ZeRO groups and their optimizer, the learning-rate
schedule, the engine's counters, the data loader, data efficiency, the offload stepper and ZenFlow,
tensor-parallel and MoE training, the pipeline stage) is one ``CheckpointPart``, built once by
``runtime/build_checkpoint.py`` and held in ``EngineParts.checkpoint_parts``. ``save_checkpoint`` and
``load_checkpoint`` iterate them in order and know nothing of any parallelism:

- ``save(snap, ctx)`` on every rank: add or drop this rank's tensors in the :class:`RankSnapshot`;
- ``meta(snap, ctx)`` on every rank, after the module's entries are described: the JSON value stored under
  ``meta.json[name]`` (a part with ``name == ""`` stores nothing; it may still adjust the snapshot, and
  may run collectives here, as every rank calls it);
- ``check(saved, ctx)`` before anything changes (``staged``, step 1): raise on what cannot be loaded;
- ``load(saved, ctx)`` after every rank agreed: restore from ``meta.json[name]`` (``saved``) and the reader.

The file format is the one ``layout`` and ``universal`` describe; the parts only decide who writes what.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class RankSnapshot:
    """Everything one rank writes: tensor files (relpath -> tensors) and JSON files (relpath -> object), and
    the pieces the parts fill in before they are put into files: this rank's shard tensors and their element
    ranges (``index``), the optimizer-state layout, the checkpoint names the optimizer owns (``grouped``),
    the module's entries and its tensors written whole (rank ``module_rank`` writes them)."""

    rank: int
    world: int
    tensor_files: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    json_files: dict[str, Any] = field(default_factory=dict)
    index: dict[str, list[int]] = field(default_factory=dict)
    shard: dict[str, torch.Tensor] = field(default_factory=dict)
    opt_layout: dict[str, Any] = field(default_factory=dict)
    grouped: set[str] = field(default_factory=set)
    entries: dict[str, Any] = field(default_factory=dict)
    module_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    module_rank: int = 0


@dataclass
class SaveContext:
    """One save: the engine (counters, module, optimizer), this rank in the writing group, and the options."""

    engine: Any
    group: Any
    names: dict[int, str]  # id(param) -> checkpoint name
    copy: bool  # async save: every tensor cloned to CPU now
    exclude_frozen: bool


@dataclass
class LoadContext:
    """One load: the engine, the checkpoint, the names and what the caller asked to load. ``check`` may
    narrow it (``partial_model``: this rank holds part of the model, a pipeline stage; ``rng``: None keeps
    this rank's RNG state)."""

    engine: Any
    ckpt: str
    meta: dict[str, Any]  # the whole meta.json
    names: dict[int, str]  # id(param) -> checkpoint name
    grouped: set[str]  # checkpoint names the optimizer owns (read from the masters)
    module_only: bool
    load_optimizer_states: bool
    load_lr_scheduler_states: bool
    partial_model: bool = False
    rng: Any = None
    layout: Any = None  # the saved optimizer-state layout under this engine's names (staged up front)
    reader: Any = None
    # pipeline_loading_checkpoint (turns.py): the masters and optimizer state were written in this rank's turn;
    # the stage-3 groups whose parameter shards are still to be written from them
    optimizer_state_loaded: bool = False
    sharded: list[Any] = field(default_factory=list)


class CheckpointPart(Protocol):
    """What one engine part keeps in a checkpoint (see the module docstring)."""

    name: str

    def save(self, snap: RankSnapshot, ctx: SaveContext) -> None: ...

    def meta(self, snap: RankSnapshot, ctx: SaveContext) -> Any: ...

    def check(self, saved: Any, ctx: LoadContext) -> None: ...

    def load(self, saved: Any, ctx: LoadContext) -> None: ...


class Part:
    """A part that keeps nothing by default: subclasses override what they hold."""

    name = ""

    def save(self, snap: RankSnapshot, ctx: SaveContext) -> None:
        return None

    def meta(self, snap: RankSnapshot, ctx: SaveContext) -> Any:
        return None

    def check(self, saved: Any, ctx: LoadContext) -> None:
        return None

    def load(self, saved: Any, ctx: LoadContext) -> None:
        return None
