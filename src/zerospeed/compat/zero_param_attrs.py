"""DeepSpeed's ``ds_*`` attributes of a ZeRO-3 parameter, read-only, from zerospeed's shard table.

transformers, PEFT, TRL and DeepSpeed-Chat read ``param.ds_numel``, ``ds_shape``, ``ds_status``, ``ds_id``,
``ds_tensor`` (and test ``hasattr(param, "ds_id")`` to tell a ZeRO-3 parameter). zerospeed keeps a
parameter's ZeRO-3 state in a side table (``zero/stage3/param_store.py``), never in attributes, so these are
properties of :class:`ZeroParameter`, the class a parameter takes when stage 3 registers it: each reads the
table at the moment it is asked, so it is always what the stage-3 runtime holds, and nothing can be set
through it. A parameter that is not (or no longer) in the table has no ``ds_*`` attributes: ``hasattr``
is False, as for an ordinary parameter. Parameters of other ``nn.Parameter`` subclasses keep their class
(and get no ``ds_*`` attributes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _shard(param: torch.Tensor) -> Any:
    from ..zero.stage3.param_store import shard_of  # here: param_store imports this module

    shard = shard_of(param)
    if shard is None:
        raise AttributeError("not a ZeRO-3 parameter: it has no ds_* attributes")
    return shard


class ZeroParameter(nn.Parameter):
    """An ``nn.Parameter`` partitioned by ZeRO-3, with DeepSpeed's read-only ``ds_*`` view of its state."""

    @property
    def ds_numel(self) -> int:
        """Elements of the whole parameter (its ``data`` may be an empty placeholder while partitioned)."""
        return int(_shard(self).numel)

    @property
    def ds_shape(self) -> torch.Size:
        """Shape of the whole parameter."""
        return _shard(self).shape

    @property
    def ds_status(self) -> Any:
        """``ZeroParamStatus``: AVAILABLE (gathered), NOT_AVAILABLE (partitioned) or INFLIGHT."""
        from .partition_parameters import param_status

        _shard(self)
        return param_status(self)

    @property
    def ds_id(self) -> int:
        """An id unique among live ZeRO-3 parameters (DeepSpeed: a running count)."""
        return id(_shard(self))

    @property
    def ds_persist(self) -> bool:
        """True for a parameter kept whole (below ``stage3_param_persistence_threshold``)."""
        return bool(_shard(self).persistent)

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's partition (flat, zero-padded to ``partition_numel()``): the live shard, or a copy read
        from its home under parameter offload; a persistent parameter's is its owned slice of the whole value."""
        shard = _shard(self)
        if shard.local is not None and (shard.home is None or shard.resident):
            return shard.local
        if shard.local is not None:
            with shard.loaded() as local:
                return local.clone()
        lo, hi = shard.owned_range()
        return self.data.reshape(-1)[lo:hi]

    def partition_numel(self) -> int:
        """Elements of each rank's partition (DeepSpeed's method)."""
        return int(_shard(self).shard)


def expose_ds_attributes(param: nn.Parameter) -> None:
    """Give a plain ``nn.Parameter`` the ``ds_*`` view (its class becomes :class:`ZeroParameter`)."""
    if type(param) is nn.Parameter:
        param.__class__ = ZeroParameter


__all__ = ["ZeroParameter", "expose_ds_attributes"]
