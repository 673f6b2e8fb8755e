"""``deepspeed.runtime.zero.partition_parameters``: ZeRO-3's ``Init``, ``GatheredParameters`` and
``ZeroParamStatus``, over zerospeed's stage-3 parameter store (``zero/stage3/param_store.py``), and the
names transformers and PEFT import from it.

zerospeed's ``zero.Init`` patches no torch constructor (it cuts each submodule as it is registered,
``zero/stage3/init.py``), so tensors made inside it keep the dtype and device they were asked for.
transformers' ``prevent_arange_dtype_change`` swaps ``zero_wrapper_for_fp_tensor_constructor`` around
``from_pretrained`` to keep ``torch.arange`` buffers in their dtype: here that swap is harmless, since
nothing wraps the constructors in the first place; the function does what DeepSpeed's does for a caller
that uses it directly."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import torch

from ..accelerator import get_accelerator
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


# The shape of a partitioned parameter's ``data`` (zerospeed's placeholder, zero/stage3/param_store.py)
partitioned_param_data_shape = [0]


class MultipleAllGatherHandles:
    """Several gather handles as one: ``wait(**kwargs)`` waits on each, passing the keywords through."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = list(handles)

    def wait(self, **kwargs: Any) -> None:
        for handle in self.handles:
            handle.wait(**kwargs)


_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Callable[..., torch.Tensor]:
    """``fn`` making its tensors on ``target_device`` and, when floating, in ``target_fp_dtype``."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = target_device if target_device is not None else get_accelerator().device()
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


__all__ = ["GatheredParameters", "Init", "MultipleAllGatherHandles", "ZeroParamStatus", "partitioned_param_data_shape", "is_zero_param", "param_status",
           "register_external_parameter", "get_accelerator", "zero_wrapper_for_fp_tensor_constructor",
           "_orig_torch_arange", "_orig_torch_empty", "_orig_torch_zeros", "_orig_torch_ones", "_orig_torch_full"]
