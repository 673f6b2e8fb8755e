"""Attribute operator counts and forward latency to the modules that run them.

Two interception layers, both active only while the root module's ``forward`` runs:

* a ``TorchDispatchMode`` sees every aten operator after autograd has decomposed composite ones, so any
  model (custom ``forward`` code included) is covered; :mod:`.rules` prices each operator;
* a ``TorchFunctionMode`` catches ``F.scaled_dot_product_attention`` as a whole, so attention costs the
  same whichever backend (fused kernel or math decomposition) runs it.

Forward hooks keep a stack of the modules currently running. An operator's counts go to every module on
the stack, so each module's numbers include its children (the root holds the model total). Operators run
by autograd's backward (e.g. an activation-checkpoint recompute) are never counted: the forward count times
``3 + recompute_fwd_factor`` is the training step's count, as in DeepSpeed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from .._device import synchronize
from .rules import attention_counts, count_op


def in_backward() -> bool:
    """True while autograd's engine is executing a backward pass on this thread."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


@dataclass
class ModuleStats:
    """Counts for one module, its children included."""

    flops: int = 0
    macs: int = 0
    duration: float = 0.0  # seconds of forward, summed over calls
    calls: int = 0


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, owner: FlopCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.owner.counting():
            self.owner.add(*count_op(func, args, kwargs, out))
        return out


class _AttentionCounter(TorchFunctionMode):
    def __init__(self, owner: FlopCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or not self.owner.counting():
            return func(*args, **kwargs)
        self.owner.suppressed += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.owner.suppressed -= 1
        q = args[0] if len(args) > 0 else kwargs["query"]
        k = args[1] if len(args) > 1 else kwargs["key"]
        v = args[2] if len(args) > 2 else kwargs["value"]
        self.owner.add(*attention_counts(q, k, v))
        return out


def _raw_dispatch_handler() -> Any:
    """Our ``__torch_dispatch__`` before torch wrapped it in ``_disable_dynamo`` (None if torch changed)."""
    return getattr(_DispatchCounter.__dict__.get("__torch_dispatch__"), "__wrapped__", None)


def _skip_dynamo_import(raw: Any) -> bool:
    """Spare the first profiled forward a multi-second ``import torch._dynamo``.

    torch wraps every dispatch-mode handler so that ``torch.compile`` never traces into it; the wrapper
    imports dynamo on first call. When dynamo is not loaded nothing can be compiling, so for the duration of
    the profile we mark the handler as already wrapped (the wrapper's own cache attribute), and remove the
    mark at detach so a later profile under ``torch.compile`` gets the real protection.
    """
    if raw is None or "torch._dynamo" in sys.modules or hasattr(raw, "__dynamo_disable"):
        return False
    setattr(raw, "__dynamo_disable", raw)
    return True


class FlopCounter:
    """Hooks a module tree; between :meth:`attach` and :meth:`detach` its forwards are counted and timed.

    Modules whose type is in ``ignore`` get no entry and the operators they run are not counted.
    """

    def __init__(self, root: nn.Module, ignore: tuple[type, ...] = ()) -> None:
        self.root = root
        self.ignore = ignore
        self.stats: dict[nn.Module, ModuleStats] = {}
        self.suppressed = 0
        self.enabled = True
        self._stack: list[tuple[nn.Module, float]] = []
        self._handles: list[RemovableHandle] = []
        self._modes: list[Any] = []
        self._skipped_dynamo = False

    # --- counting -------------------------------------------------------------------------------------
    def counting(self) -> bool:
        return self.enabled and bool(self._stack) and self.suppressed == 0 and not in_backward()

    def add(self, flops: int, macs: int) -> None:
        if not flops and not macs:
            return
        for module in {m for m, _ in self._stack}:
            stats = self.stats[module]
            stats.flops += flops
            stats.macs += macs

    def reset(self) -> None:
        self.stats = {m: ModuleStats() for m in self.root.modules() if not isinstance(m, self.ignore)}

    # --- hooks ----------------------------------------------------------------------------------------
    def attach(self) -> None:
        if self._handles:
            return
        self.reset()
        self._skipped_dynamo = _skip_dynamo_import(_raw_dispatch_handler())
        for module in self.root.modules():
            if isinstance(module, self.ignore):
                self._handles.append(module.register_forward_pre_hook(self._ignored_pre))
                self._handles.append(module.register_forward_hook(self._ignored_post, always_call=True))
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self._modes:
            self._modes.pop().__exit__(None, None, None)
        self._stack.clear()
        raw = _raw_dispatch_handler()
        if self._skipped_dynamo and getattr(raw, "__dynamo_disable", None) is raw:
            delattr(raw, "__dynamo_disable")
        self._skipped_dynamo = False

    def _pre(self, module: nn.Module, args: Any) -> None:
        if not self.enabled or in_backward():
            return
        if module is self.root and not self._modes:
            for mode in (_AttentionCounter(self), _DispatchCounter(self)):
                mode.__enter__()
                self._modes.append(mode)
        synchronize()
        self._stack.append((module, time.perf_counter()))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack or self._stack[-1][0] is not module:
            return
        synchronize()
        _, started = self._stack.pop()
        stats = self.stats[module]
        stats.duration += time.perf_counter() - started
        stats.calls += 1
        if module is self.root and not self._stack:
            while self._modes:
                self._modes.pop().__exit__(None, None, None)

    def _ignored_pre(self, module: nn.Module, args: Any) -> None:
        if self._stack:
            self.suppressed += 1

    def _ignored_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack and self.suppressed:
            self.suppressed -= 1
