"""Module hooks that gather a module's parameters around its forward and its backward.

* forward pre-hook: hold the module's unit for ``forward`` (gather; prefetch the next units);
* forward post-hook (also on exceptions): release ``forward``; when grad is on, a gradient hook on the
  module's outputs (``register_multi_grad_hook``, mode ``any``) holds the unit for ``backward`` as soon
  as the first output gradient arrives, i.e. just before the module's own backward runs;
* the ``backward`` hold ends when every trainable parameter of the unit has its gradient accumulated
  (``Fetcher.on_grad``, called by the stage-3 gradient reducer), or at the end of backward.

The root module's hooks mark pass boundaries, and on an exception add a note explaining partitioned
parameters (the usual cause being a parameter used outside the module that owns it).

Under ``engine.compile()`` every hook is excluded from tracing (``torch._disable_dynamo``, lazy like
DeepSpeed's ``compiler.lazy_disable``): a deliberate graph break, so the partitioning logic stays eager and
each module's compute between two hooks compiles (``runtime/compile.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .fetcher import BACKWARD, FORWARD, Fetcher, Unit
from .lockstep import RanksDivergedError

HINT = (
    "zerospeed ZeRO stage 3: parameters are partitioned; a parameter is whole only during the forward "
    "and backward of the module that owns it (elsewhere its data is an empty tensor of shape (0,)). "
    "To use a parameter outside its module (read or written outside forward, or applied by another "
    "module, e.g. a tied weight used with F.linear), wrap the code in "
    "`with zerospeed.zero.GatheredParameters(params):` or call "
    "`zerospeed.zero.register_external_parameter(module, param)` before initialize()."
)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors that need a gradient inside a module's output (tensors, sequences, mappings)."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


@torch._disable_dynamo
def _pre_forward(fetcher: Fetcher, unit: Unit, module: nn.Module, args: Any) -> None:
    fetcher.acquire(unit, FORWARD, track=torch.is_grad_enabled())


@torch._disable_dynamo
def _post_forward(fetcher: Fetcher, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
    fetcher.release(unit, FORWARD)
    if output is None or not torch.is_grad_enabled():
        return
    tensors = list(_tensors(output))
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda grads: fetcher.acquire(unit, BACKWARD, track=True), mode="any")


@torch._disable_dynamo
def _root_pre(fetcher: Fetcher, module: nn.Module, args: Any) -> None:
    fetcher.begin_forward()


@torch._disable_dynamo
def _root_post(fetcher: Fetcher, module: nn.Module, args: Any, output: Any) -> None:
    exc = sys.exc_info()[1]
    fetcher.end_forward(clean=exc is None)
    if isinstance(exc, RanksDivergedError):
        return  # its message says what happened; the note on partitioned parameters would mislead
    if output is None and exc is not None and hasattr(exc, "add_note") and HINT not in getattr(exc, "__notes__", []):
        exc.add_note(HINT)


def install(root: nn.Module, fetcher: Fetcher, unit_of: dict[int, Unit]) -> list[RemovableHandle]:
    """Register the hooks on ``root`` and every module that owns a unit."""
    handles = [root.register_forward_pre_hook(partial(_root_pre, fetcher), prepend=True)]
    for module in root.modules():
        unit = unit_of.get(id(module))
        if unit is None:
            continue
        handles.append(module.register_forward_pre_hook(partial(_pre_forward, fetcher, unit)))
        handles.append(module.register_forward_hook(partial(_post_forward, fetcher, unit), always_call=True))
    handles.append(root.register_forward_hook(partial(_root_post, fetcher), always_call=True))
    return handles
