"""``engine.save_16bit_model``: the whole model in its compute dtype as one safetensors file, on one rank.

One export per layout, chosen once by the builder (``runtime/build_checkpoint.model_export``):

* :class:`ReplicatedExport` - plain / ZeRO 0-3: ``zero.stage3.save_16bit_model`` over the data-parallel group
  (stage 3 gathers, which needs ``stage3_gather_16bit_weights_on_model_save: true`` as in DeepSpeed);
* :class:`ExpertExport` - expert parallelism (ep > 1): every expert under its global id
  (``parallel/expert/checkpoint.with_all_experts``: the first rank of each expert-data group sends its experts);
* :class:`TensorParallelExport` - AutoTP (ZeRO 0-2): the split layers joined over the tensor group
  (``parallel/tensor/export.full_state_dict``), experts then gathered over the world (AutoEP folding: expert
  groups span the tensor groups); global rank 0 writes. Without this every tensor rank wrote its own shards to
  the same file.

Each is a collective over the engine's ranks and returns True on the rank that wrote the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from .. import comm
from ..config import ConfigError
from ..parallel.expert.checkpoint import with_all_experts
from ..parallel.tensor.export import full_state_dict as tensor_full_state_dict
from ..zero.stage3 import full_state_dict, save_16bit_model, save_safetensors

__all__ = ["ExpertExport", "ModelExport", "ReplicatedExport", "TensorParallelExport"]


class ModelExport(Protocol):
    def __call__(self, module: nn.Module, save_dir: str, save_filename: str,
                 exclude_frozen_parameters: bool) -> bool: ...


def _require_gather(zero3: Any) -> None:
    """Stage 3 (``zero3``, the ZeRO-3 runtime) gathers only when told to (its flag, read at each save)."""
    if zero3 is not None and not zero3.gather_16bit_on_save:
        raise ConfigError("zero_optimization.stage3_gather_16bit_weights_on_model_save",
                          "under ZeRO stage 3 saving a 16-bit model gathers the partitioned parameters; set it "
                          "to true (or export with zerospeed.zero.full_state_dict)")


def _refuse_frozen_exclusion(exclude_frozen_parameters: bool) -> None:
    if exclude_frozen_parameters:
        raise NotImplementedError("save_16bit_model(exclude_frozen_parameters=True) with expert or tensor "
                                  "parallelism is not supported yet by zerospeed")


@dataclass(frozen=True)
class ReplicatedExport:
    """Every parameter is whole on each data-parallel rank, or partitioned by ZeRO-3 and gathered here."""

    dp_group: comm.Group | None
    zero3: Any = None  # the ZeRO-3 runtime under stage 3 (its stage3_gather_16bit_weights_on_model_save)

    def __call__(self, module: nn.Module, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> bool:
        _require_gather(self.zero3)
        return save_16bit_model(module, save_dir, save_filename, group=self.dp_group,
                                exclude_frozen_parameters=exclude_frozen_parameters)


@dataclass(frozen=True)
class ExpertExport:
    """Each rank holds its own experts: they are collected under their global ids on data-parallel rank 0."""

    dp_group: comm.Group | None
    zero3: Any = None

    def __call__(self, module: nn.Module, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> bool:
        _require_gather(self.zero3)
        _refuse_frozen_exclusion(exclude_frozen_parameters)
        state = with_all_experts(full_state_dict(module, group=self.dp_group), module, self.dp_group)
        writer = comm.get_rank(self.dp_group) == 0
        if writer:
            save_safetensors(state, os.path.join(save_dir, save_filename))
        return writer


@dataclass(frozen=True)
class TensorParallelExport:
    """AutoTP: the tensor group's shards joined, then (``experts``) every expert over the world; rank 0 writes."""

    experts: bool = False

    def __call__(self, module: nn.Module, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> bool:
        _refuse_frozen_exclusion(exclude_frozen_parameters)
        state = tensor_full_state_dict(module)  # collective over the tensor group
        writer = comm.get_rank() == 0
        if self.experts:
            state = with_all_experts(state if writer else {}, module, None)
        if writer:
            save_safetensors(state, os.path.join(save_dir, save_filename))
        return writer
