"""``zero.MiCS_Init``: DeepSpeed's MiCS-aware ``zero.Init``, with its signature, refused by name while enabled.

DeepSpeed's ``MiCS_Init`` cuts each parameter over its ``mics_shard_size`` shard group as the model is built.
zerospeed's :class:`~zerospeed.zero.stage3.init.Init` cuts over the whole data-parallel group, and its stage 3
(``setup._prepare``) refuses a model built under ``zero.Init`` when ``mics_shard_size`` is set, so serving
``MiCS_Init`` as ``Init`` would fail later, at ``initialize()``, under another name. An enabled ``MiCS_Init``
therefore raises ``NotSupportedYetError`` naming it at once; MiCS itself works on a model built outside it
(``initialize()`` with ``zero_optimization.mics_shard_size``). ``enabled=False`` is, as in DeepSpeed, a block
with no effect.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ... import comm
from ...config.errors import NotSupportedYetError
from .init import Init
from .mics import KEY


class MiCS_Init(Init):  # noqa: N801 - DeepSpeed's class name
    def __init__(self, module: nn.Module | None = None, data_parallel_group: comm.Group | None = None,
                 sequence_data_parallel_group: comm.Group | None = None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None) -> None:
        if enabled:
            raise NotSupportedYetError(KEY, "zero.MiCS_Init (parameters cut over the MiCS shard groups while the "
                                       "model is built) is not supported yet by zerospeed: build the model outside "
                                       "it; initialize() with zero_optimization.mics_shard_size partitions it")
        super().__init__(enabled=False)


__all__ = ["MiCS_Init"]
