"""Inside ``zero.Init``: torch calls that touch an already-cut parameter see its full value.

A parent module often re-initialises its children's weights after they were attached (and so cut):
``self.apply(self._init_weights)``, ``nn.init.normal_(child.weight)``, ``p.data.zero_()``,
``p.data = tensor``. Without help those calls would read or write an empty placeholder and the model
would silently keep the wrong values. This ``TorchFunctionMode`` (torch's public extension point; nothing
is patched) sees every torch call made inside the ``Init`` block. When one involves a cut parameter
(the parameter itself, or an alias of its ``.data``), the parameter is gathered for the call (a
collective: every rank runs the same constructor, so every rank makes the same calls), the call runs on
the full value, an in-place change is written back into this rank's shard, and the parameter is cut
again. A call whose result would alias the gathered value (a slice or view kept past the call) raises,
pointing to ``GatheredParameters``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .gathered import GatheredParameters
from .param_store import ParamShard, ShardState, shard_of

# Properties that never need the full value (``data`` returns the placeholder alias, matched later).
_METADATA = {"data", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "layout", "is_cuda",
             "is_sparse", "is_meta", "name", "names", "_base", "_cdata"}


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


class CutParameterWrites(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self._placeholders: dict[int, ParamShard] = {}

    def remember(self, shard: ParamShard) -> None:
        """Track the placeholder storage of a freshly cut parameter (its ``.data`` aliases share it)."""
        key = _storage_key(shard.param)
        if key is not None:
            self._placeholders[key] = shard

    def _shard(self, t: Any) -> ParamShard | None:
        if not isinstance(t, torch.Tensor):
            return None
        s = shard_of(t)
        if s is None and t.numel() == 0:
            s = self._placeholders.get(_storage_key(t) or -1)
            owner = s._param() if s is not None else None
            if owner is None or _storage_key(owner) != _storage_key(t):
                s = None  # a stale entry (its parameter is gone, or the storage address was reused)
        if s is not None and s.state is ShardState.SHARDED and s.local is not None:
            return s
        return None

    def _cut_args(self, args: tuple, kwargs: dict) -> Iterator[tuple[int | str, ParamShard]]:
        for i, a in enumerate(args):
            s = self._shard(a)
            if s is not None:
                yield i, s
        for k, v in kwargs.items():
            s = self._shard(v)
            if s is not None:
                yield k, s

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        prop = getattr(getattr(func, "__self__", None), "__name__", None)
        if getattr(func, "__name__", "") == "__get__" and prop in _METADATA:
            return func(*args, **kwargs)
        found = list(self._cut_args(args, kwargs))
        if not found:
            return func(*args, **kwargs)
        shards = list({id(s): s for _, s in found}.values())
        original: dict[int | str, Any] = {**dict(enumerate(args)), **kwargs}
        call_args = list(args)
        with GatheredParameters([s.param for s in shards]):
            for where, s in found:  # point the call at the full value
                if isinstance(where, int):
                    call_args[where] = s.param if call_args[where] is s.param else s.param.data
                else:
                    kwargs[where] = s.param if kwargs[where] is s.param else s.param.data
            result = func(*call_args, **kwargs)
            writes = getattr(func, "__name__", "").endswith("_") or prop == "data" or \
                getattr(func, "__name__", "") in ("__setitem__", "__set__")
            if writes:
                for s in shards:
                    s.refresh_local()
            full = {_storage_key(s.param) for s in shards}
            passed = {**dict(enumerate(call_args)), **kwargs}
            returned = next((k for k, v in passed.items() if v is result), None) if isinstance(result, torch.Tensor) else None
            if isinstance(result, torch.Tensor) and returned is None and _storage_key(result) in full:
                raise RuntimeError(
                    f"zero.Init: '{getattr(func, '__name__', func)}' returned a view of a partitioned parameter "
                    "(shape " + ", ".join(str(tuple(s.shape)) for s in shards) + "); it would be empty once the "
                    "parameter is cut again. Change it inside `with zerospeed.zero.GatheredParameters(p, "
                    "modifier_rank=0):` instead.")
        for s in shards:
            s.drop_buffer()
            self.remember(s)
        if returned is not None:  # an in-place op returns its target: hand back what the caller passed
            return original[returned]
        return result
