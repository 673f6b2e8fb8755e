"""``engine.compile()`` with ``compile.deepcompile: true``: ZeRO inside the compiled graph (DeepSpeed's DeepCompile).

* ZeRO-3: stage 3's module hooks (graph breaks) are removed; the model's call becomes
  :class:`~zerospeed.zero.stage3.graph_forward.GraphForward` (gathers and gradient hand-offs as custom graph
  ops), compiled as one graph (``fullgraph=True``: a break is an error, not a silent fallback);
* ZeRO-0/1/2: the model touches ZeRO only through gradient hooks that autograd runs after the compiled
  backward, so plain ``torch.compile`` already gives one graph with no break; DeepCompile compiles it with
  ``fullgraph=True`` too (a break raises).

The backend is wrapped by the graph passes (``graph_passes.py``) named in ``compile.passes``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..accelerator import get_accelerator
from ..config.compile import CompileConfig

_log = logging.getLogger("zerospeed.compile")


@dataclass
class DeepCompiled:
    """What ``engine.compile()`` built under DeepCompile (for checks and reports)."""

    graph: Any = None  # zero/stage3/graph_ops.GraphUnits at stage 3, else None
    forward: Any = None  # zero/stage3/graph_forward.GraphForward at stage 3, else None


def deep_compile(module: nn.Module, backend: Any, compile_kwargs: dict[str, Any], cfg: CompileConfig,
                 zero3: Any = None, reducer: Any = None) -> DeepCompiled:
    """Compile ``module`` in place with DeepCompile; ``zero3``: its stage-3 runtime (None below stage 3),
    ``reducer``: the gradient reducer the graph's gradient hand-offs feed."""
    backend = get_accelerator().get_compile_backend() if backend is None else backend
    kwargs = {**compile_kwargs, "backend": backend, "fullgraph": True}
    if zero3 is None:
        _log.info("DeepCompile below stage 3: the model compiles as one graph (backend=%s)", backend)
        module.compile(**kwargs)
        return DeepCompiled()
    if reducer is None:
        raise ValueError("compile.deepcompile at ZeRO stage 3 needs an optimizer (its reducer takes the gradients)")
    from ..zero.stage3.graph_forward import GraphForward
    from ..zero.stage3.graph_ops import GraphUnits

    graph = GraphUnits(zero3.units, reducer.take_grad)
    if cfg.debug_log:
        graph.log = []
    forward = GraphForward(module, graph)
    zero3.remove_module_hooks()
    forward.run = torch.compile(forward.forward, **kwargs)
    module._compiled_call_impl = forward  # nn.Module.__call__ runs it (as nn.Module.compile does)
    _log.info("DeepCompile at stage 3: %d units gathered in the graph (backend=%s)", len(graph.units), backend)
    return DeepCompiled(graph, forward)


__all__ = ["DeepCompiled", "deep_compile"]
