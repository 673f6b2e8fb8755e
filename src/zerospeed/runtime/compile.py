"""``engine.compile()``: ``torch.compile`` of the model under every ZeRO stage (DeepSpeed's path without
DeepCompile).

The model is compiled in place (``nn.Module.compile``), so ``engine.module`` stays the same object and
parameter names, state dicts and checkpoints do not change. Stages 0-2 touch the model only through
gradient hooks, which the autograd engine runs after each compiled backward graph as in eager: the whole
forward is one graph. What stays eager, deliberately:

* stage 3's gather and release hooks (``zero/stage3/hooks.py``) are excluded from tracing: each is a graph
  break, so the compute of each module between two hooks compiles while collectives, prefetch and offload
  run eagerly. The graphs are traced in the first step and reused after (no recompilation: a parameter is
  always whole, with the same shape, while its module's graph runs). A module whose call breaks the graph
  compiles as a frame of its own, one per class: layers of one class with different shapes share it
  through dynamo's automatic dynamic shapes, so ``compile_kwargs={"dynamic": False}`` recompiles it per
  shape and, past ``torch._dynamo.config.recompile_limit`` (8) shapes, runs the rest eagerly (warned);
* an activation-checkpointed region (``zerospeed.checkpointing.checkpoint``) runs eagerly: its recompute hands
  saved tensors back by position, which only the same eager operations reproduce.

With ``compile.deepcompile: true`` the engine runs ``runtime/deepcompile.py`` instead (ZeRO inside the graph,
no breaks; docs/compile.md). With ``compile.autoep_non_moe: true`` only the parents of AutoEP's MoE blocks compile
(:func:`compile_autoep_regions`, DeepSpeed's regional compile). Not built: compiled autograd (tracing the backward, which would trace the
reducer's collectives).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from ..accelerator import get_accelerator

_log = logging.getLogger("zerospeed.compile")


def compile_engine_module(module: nn.Module, cfg: Any, zero3: Any, optimizer: Any, backend: Any,
                          compile_kwargs: dict[str, Any], schedule: Any, compiled_autograd_enabled: bool) -> Any:
    """``engine.compile()``: DeepCompile when ``cfg.deepcompile`` (returns its ``DeepCompiled``), else plain
    ``torch.compile`` (returns None). ``cfg``: the ``compile`` section; ``zero3``: the stage-3 runtime or None;
    ``optimizer``: the engine's ZeRO optimizer or None."""
    if cfg.autoep_non_moe:
        compile_autoep_regions(module, backend, compile_kwargs, schedule, compiled_autograd_enabled)
        return None
    if not cfg.deepcompile:
        compile_module(module, backend, compile_kwargs, schedule, compiled_autograd_enabled, partitioned=zero3 is not None)
        return None
    from .deepcompile import deep_compile

    check_compile_args(compile_kwargs, None, compiled_autograd_enabled)
    return deep_compile(module, backend, compile_kwargs, cfg, zero3, optimizer, schedule)


def compile_module(module: nn.Module, backend: Any, compile_kwargs: dict[str, Any], schedule: Any,
                   compiled_autograd_enabled: bool, partitioned: bool = False) -> None:
    """Compile ``module`` in place with ``torch.compile(backend=..., **compile_kwargs)``; ``partitioned``:
    ZeRO stage 3's hooks are installed on it."""
    check_compile_args(compile_kwargs, schedule, compiled_autograd_enabled)
    if partitioned and compile_kwargs.get("dynamic") is False:
        warnings.warn("engine.compile(compile_kwargs={'dynamic': False}) under ZeRO stage 3: each module between "
                      "two gather/release hooks compiles as a frame of its own class, once per parameter shape; "
                      "past torch._dynamo.config.recompile_limit shapes per class the rest run eagerly. Leave "
                      "'dynamic' unset to share one graph per class", stacklevel=3)
    backend = get_accelerator().get_compile_backend() if backend is None else backend
    _log.info("compiling the model with torch.compile (backend=%s)", backend)
    module.compile(**{**compile_kwargs, "backend": backend})


def compile_autoep_regions(module: nn.Module, backend: Any, compile_kwargs: dict[str, Any], schedule: Any,
                           compiled_autograd_enabled: bool) -> list[str]:
    """``compile.autoep_non_moe`` (DeepSpeed's AutoEP regional compile): each MoE block that AutoEP rebuilt (the HF
    block holding an ``AutoEPExperts``: router, token exchange, expert compute, all-to-alls) stays eager
    (``torch.compiler.disable``), and the module that calls it (the decoder layer) compiles with
    ``fullgraph=False, dynamic=False``: the block is a graph break of its own. Returns the compiled regions' names."""
    from ..parallel.expert.auto.layer import AutoEPExperts

    check_compile_args(compile_kwargs, schedule, compiled_autograd_enabled)
    if compile_kwargs.get("fullgraph", False) is not False:
        raise ValueError("compile.autoep_non_moe=True requires fullgraph=False: the AutoEP block is a graph break")
    if compile_kwargs.get("dynamic", False) is not False:
        raise ValueError("compile.autoep_non_moe=True requires dynamic=False (as in DeepSpeed)")
    named = dict(module.named_modules())
    blocks = [name.rpartition(".")[0] for name, m in named.items() if isinstance(m, AutoEPExperts)]
    if not blocks:
        raise ValueError("compile.autoep_non_moe=True needs at least one AutoEP MoE layer: enable expert_parallel "
                         "and call engine.compile() after zerospeed.initialize()")
    regions: dict[str, nn.Module] = {}
    for block in blocks:
        if not block:
            raise ValueError("compile.autoep_non_moe=True cannot compile an AutoEP MoE block at the model root")
        parent = block.rpartition(".")[0]
        region = named[parent]
        if type(region).forward is nn.Module.forward:
            raise ValueError(f"AutoEP compile region '{parent}' has no forward: the MoE block must be a direct "
                             "child of a module that calls it")
        regions.setdefault(parent, region)
    for block in blocks:
        named[block].forward = torch.compiler.disable(named[block].forward)
    backend = get_accelerator().get_compile_backend() if backend is None else backend
    for name, region in regions.items():
        region.compile(**{"fullgraph": False, "dynamic": False, **compile_kwargs, "backend": backend})
        _log.info("AutoEP regional compile: compiled '%s' (backend=%s); its MoE block stays eager", name, backend)
    return list(regions)


def check_compile_args(compile_kwargs: dict[str, Any], schedule: Any, compiled_autograd_enabled: bool) -> None:
    """``engine.compile()``'s arguments: refused by name where not built."""
    if schedule is not None:
        raise NotImplementedError("engine.compile(schedule=...) without compile.deepcompile: true is not supported "
                                  "yet by zerospeed (a schedule names DeepCompile passes, which DeepSpeed ignores "
                                  "without DeepCompile): set compile.deepcompile: true in the config, or drop it")
    if compiled_autograd_enabled:
        raise NotImplementedError("engine.compile(compiled_autograd_enabled=True) is not supported yet by zerospeed "
                                  "(the backward stays eager autograd over the compiled graphs)")
    if not isinstance(compile_kwargs, dict):
        raise ValueError(f"engine.compile(compile_kwargs=...) expects a dict of torch.compile options, got "
                         f"{type(compile_kwargs).__name__}")
    if "backend" in compile_kwargs:
        _log.warning("The `backend` in `compile_kwargs` will be overridden. Use the `backend` argument instead.")


def compiled_graph_count() -> dict[str, int]:
    """Dynamo's counts so far in this process: graphs compiled, graph breaks, frames traced (for checks
    that steady-state steps compile nothing new)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "frames": int(counters["frames"]["total"])}


# --- DeepSpeed's ``deepspeed.runtime.compiler`` helpers (served at ``zerospeed.runtime.compiler``) -----------
def is_compile_supported() -> bool:
    """True: zerospeed's torch (2.13) has ``torch.compile``."""
    return hasattr(torch, "compile")


def is_compiling() -> bool:
    """True while dynamo traces the calling code (``torch.compiler.is_compiling``)."""
    return torch.compiler.is_compiling()


def disable(func: Any) -> Any:
    """``func`` excluded from tracing (``torch.compiler.disable``): a graph break where it is called."""
    return torch.compiler.disable(func)


__all__ = ["check_compile_args", "compile_autoep_regions", "compile_engine_module", "compile_module", "compiled_graph_count", "disable",
           "is_compile_supported", "is_compiling"]
