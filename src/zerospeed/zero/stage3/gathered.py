"""``GatheredParameters``: hold ZeRO-3 parameters whole inside a block, to read them or to change them.

Every rank must enter the block with the same parameters (the gather is a collective). Inside, each
parameter is its full tensor. With ``modifier_rank=r`` the value rank ``r`` (a global rank) leaves at
exit is broadcast to every rank and re-partitioned, and the optimizer's fp32 master copy, when there is
one, is reloaded from it. References taken inside the block (``p.data``, a ``state_dict()``) stay valid
after it: the gathered buffer is handed to them, not shrunk. Tensors that are not partitioned (stages 0-2, plain modules) pass through:
the block then does nothing for them, except that with a modifier the change is still broadcast for
parameters registered under stage 3 as persistent.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ... import comm
from .param_store import ParamShard, ensure_gathered, shard_of
from .sanity import VersionGuard


def _as_list(params: Any) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, nn.Module):
        return list(params.parameters())
    if isinstance(params, Iterable):
        return list(params)
    raise TypeError(f"GatheredParameters expects a parameter or an iterable of parameters, got {type(params).__name__}")


class GatheredParameters:
    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        seen: dict[int, ParamShard] = {}
        if enabled:
            for p in _as_list(params):
                s = shard_of(p)
                if s is not None:
                    seen.setdefault(id(s), s)
        self.shards = list(seen.values())
        self.guard: VersionGuard | None = None

    def __enter__(self) -> GatheredParameters:
        if not self.shards:
            return self
        for s in self.shards:
            s.holders.add(self)
        ensure_gathered(self.shards)
        if self.modifier_rank is None and any(s.sanity_checks for s in self.shards):
            self.guard = VersionGuard([s.param for s in self.shards], [f"parameter of shape {tuple(s.shape)}"
                                                                      for s in self.shards], self.shards[0].group)
        return self

    @torch.no_grad()
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.shards:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                for s in self.shards:
                    # the modifier's rank in the parameter's group, as DeepSpeed (an MoE expert's: its edp group)
                    comm.broadcast(s.param.data, src=comm.global_rank_of(s.group, self.modifier_rank), group=s.group)
                    s.refresh_local()
                    for callback in s.on_modified:
                        callback()  # type: ignore[operator]
            if self.guard is not None and exc_type is None:
                self.guard.check()  # enable_sanity_checks: raises (on every rank) after the release below
        finally:
            for s in self.shards:
                s.holders.discard(self)
                if not s.persistent:
                    s.hand_off_full()  # tensors the block handed out stay valid after it
                s.release()
