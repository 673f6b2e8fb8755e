"""Attribute function-call counts and forward latency to the modules that run them, as DeepSpeed does.

DeepSpeed monkey-patches ``torch.nn.functional`` and a few tensor methods and counts their calls. We patch
nothing: a ``TorchFunctionMode`` sees the same calls (``F.linear``, ``torch.matmul``, ``Tensor.add`` ...)
and :mod:`.rules` prices the ones DeepSpeed counts. The mode re-enters itself around each call it
forwards, so functions called *inside* another torch function (``F.multi_head_attention_forward`` calling
``F.linear``) are counted too, exactly as DeepSpeed's patched globals see them.

Attribution follows DeepSpeed's frames: each hooked module's forward opens a frame, a counted call goes to
the innermost open frame, and a module's figure is its own frame plus its children's figures. A module in
``ignore`` gets no frame (the calls it makes count for its parent, as in DeepSpeed); RNN modules get no frame
either and are priced as a whole by :func:`.rules.rnn_module_flops`.

Calls made by autograd's backward (an activation-checkpoint recompute) are never counted: a training step
is the forward count times ``3 + recompute_fwd_factor``, as in DeepSpeed.
"""

from __future__ import annotations

import dis
import sys
import time
from types import FunctionType
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from .._device import synchronize
from .rules import OPERATOR_METHODS, POOL_ALIASES, RNN_MODULES, RULES, count_call, rnn_module_flops

_REDISPATCH = getattr(torch.overrides, "redispatch_function", None)
_OPERATOR_OPCODES = frozenset(
    dis.opmap[name] for name in dis.opmap if name.startswith(("BINARY_", "INPLACE_")) and "SUBSCR" not in name
)


def in_backward() -> bool:
    """True while autograd's engine is executing a backward pass on this thread."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _called_as_operator() -> bool:
    """Whether the Python frame that reached the mode is executing an operator (``a * b``), not a call."""
    frame = sys._getframe(2)  # 0: this function, 1: __torch_function__, 2: the caller
    return frame.f_lasti >= 0 and frame.f_code.co_code[frame.f_lasti] in _OPERATOR_OPCODES


def _has_python_body(func: Any) -> bool:
    """A Python function whose body may call torch functions: not a builtin, and not a ``Tensor`` method
    (those call their own builtin through ``super()``, which would come back to the mode forever)."""
    return isinstance(func, FunctionType) and not func.__qualname__.startswith(("Tensor.", "_TensorBase."))


@dataclass
class ModuleStats:
    """Counts for one module, its children included."""

    flops: int = 0
    macs: int = 0
    duration: float = 0.0  # seconds of forward, summed over calls
    calls: int = 0


class _CallCounter(TorchFunctionMode):
    def __init__(self, owner: FlopCounter) -> None:
        super().__init__()
        self.owner = owner
        self.pooling = 0  # inside a counted pooling call (its *_with_indices helper is not counted again)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        owner = self.owner
        pooling = func in POOL_ALIASES or (func in RULES and "pool" in getattr(func, "__name__", ""))
        if owner.counting() and not (func in OPERATOR_METHODS and _called_as_operator()) \
                and not (func in POOL_ALIASES and self.pooling):
            counts = count_call(func, args, kwargs)
            if counts is not None:
                owner.add(*counts)
        if _REDISPATCH is None or not _has_python_body(func):
            return func(*args, **kwargs)
        self.pooling += pooling
        try:
            with self:  # a Python function (F.multi_head_attention_forward): count the torch functions it calls
                return _REDISPATCH(func, types, args, kwargs)
        finally:
            self.pooling -= pooling


class FlopCounter:
    """Hooks a module tree; between :meth:`attach` and :meth:`detach` its forwards are counted and timed."""

    def __init__(self, root: nn.Module, ignore: tuple[type, ...] = ()) -> None:
        self.root = root
        self.ignore = ignore
        self.own: dict[nn.Module, list[float]] = {}  # module -> [flops, macs] of its own frame
        self.timing: dict[nn.Module, list[float]] = {}  # module -> [seconds, calls]
        self.enabled = True
        self._frames: list[nn.Module] = []
        self._started: list[tuple[nn.Module, float]] = []
        self._handles: list[RemovableHandle] = []
        self._mode: _CallCounter | None = None

    # --- counting -------------------------------------------------------------------------------------
    def counting(self) -> bool:
        return self.enabled and bool(self._frames) and not in_backward()

    def add(self, flops: float, macs: float) -> None:
        own = self.own[self._frames[-1]]
        own[0] += flops
        own[1] += macs

    def reset(self) -> None:
        self.own = {m: [0, 0] for m in self.root.modules()}
        self.timing = {m: [0.0, 0] for m in self.root.modules()}

    def stats(self, module: nn.Module) -> ModuleStats:
        """A module's counts: the frames of it and every module under it (each once, as DeepSpeed sums)."""
        out = ModuleStats(duration=self.duration(module), calls=int(self.timing.get(module, [0.0, 0])[1]))
        for m in module.modules():
            own = self.own.get(m, [0, 0])
            out.flops += own[0]
            out.macs += own[1]
        return out

    def duration(self, module: nn.Module) -> float:
        """Forward seconds; a container that never ran forward itself (ModuleList) gets its children's."""
        seconds = self.timing.get(module, [0.0, 0])[0]
        return seconds if seconds else sum(self.duration(c) for c in module.children())

    # --- hooks ----------------------------------------------------------------------------------------
    def attach(self) -> None:
        if self._handles:
            return
        self.reset()
        for module in self.root.modules():
            if type(module) in self.ignore:  # exact types, as DeepSpeed matches them
                continue
            if type(module) in RNN_MODULES:
                self._handles.append(module.register_forward_hook(self._rnn_post))
            else:
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._frames.clear()
        self._started.clear()
        self._exit_mode()

    def _enter_mode(self) -> None:
        if self._mode is None:
            self._mode = _CallCounter(self)
            self._mode.__enter__()

    def _exit_mode(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _pre(self, module: nn.Module, args: Any) -> None:
        if not self.enabled or in_backward():
            return
        if not self._frames:
            self._enter_mode()
        synchronize()
        self._frames.append(module)
        self._started.append((module, time.perf_counter()))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._frames or self._frames[-1] is not module:
            return
        synchronize()
        self._frames.pop()
        _, started = self._started.pop()
        timing = self.timing[module]
        timing[0] += time.perf_counter() - started
        timing[1] += 1
        if not self._frames:
            self._exit_mode()

    def _rnn_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.enabled and not in_backward():
            self.own[module][0] += rnn_module_flops(module, args)
