"""``deepspeed.runtime.zero.partition_parameters``: ZeRO-3's ``Init``, ``GatheredParameters`` and
``ZeroParamStatus``, over zerospeed's stage-3 parameter store (``zero/stage3/param_store.py``)."""

from __future__ import annotations

from enum import Enum

import torch

from ..zero.stage3 import GatheredParameters, Init, ShardState, register_external_parameter, shard_of


class ZeroParamStatus(Enum):
    """DeepSpeed's names for a ZeRO-3 parameter's state."""

    AVAILABLE = 1  # gathered: the full value is usable
    NOT_AVAILABLE = 2  # partitioned: only this rank's shard is held
    INFLIGHT = 3  # an all-gather is under way


_STATUS = {ShardState.GATHERED: ZeroParamStatus.AVAILABLE, ShardState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
           ShardState.GATHERING: ZeroParamStatus.INFLIGHT}


def param_status(param: torch.Tensor) -> ZeroParamStatus:
    """The DeepSpeed status of ``param`` (an ordinary tensor is always AVAILABLE)."""
    shard = shard_of(param)
    return ZeroParamStatus.AVAILABLE if shard is None else _STATUS[shard.state]


def is_zero_param(param: torch.Tensor) -> bool:
    """True for a parameter partitioned by ZeRO-3 (DeepSpeed tests ``hasattr(p, "ds_id")``)."""
    return shard_of(param) is not None


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "is_zero_param", "param_status",
           "register_external_parameter"]
