"""``engine.compile()`` with ``compile.deepcompile: true``: ZeRO inside the compiled graph (DeepSpeed's DeepCompile).

* ZeRO-3: stage 3's module hooks (graph breaks) are removed; the model's call becomes
  :class:`~zerospeed.zero.stage3.graph_forward.GraphForward` (gathers and gradient hand-offs as custom graph
  ops), compiled as one graph (``fullgraph=True``: a break is an error, not a silent fallback);
* ZeRO-0/1/2: the model touches ZeRO only through gradient hooks that autograd runs after the compiled
  backward, so plain ``torch.compile`` already gives one graph with no break; DeepCompile compiles it with
  ``fullgraph=True`` too (a break raises).

The backend is wrapped by the graph passes (``graph_passes.py``) named in ``compile.passes``. At ZeRO-3 the offload
keys add DeepSpeed's offload passes in place of prefetch and selective gather (as in DeepSpeed):
``offload_opt_states`` and ``offload_parameters`` (``deepcompile_offload.py``), ``offload_activation``
(``zero/stage3/graph_offload.py``, ``aot_eager`` only).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..accelerator import can_pin_memory, get_accelerator
from ..config.compile import CompileConfig
from ..config.errors import ConfigError, NotSupportedYetError

_log = logging.getLogger("zerospeed.compile")

# Part of the inductor pass's cache key: bump it when the graph passes or the graph ops' schemas change (2:
# z3_prefetch takes a list of units; 3: z3_schedule heads each graph), so code inductor cached on disk for the
# old ones is never reused.
PASS_VERSION = 3


@dataclass
class DeepCompiled:
    """What ``engine.compile()`` built under DeepCompile (for checks and reports)."""

    graph: Any = None  # zero/stage3/graph_ops.GraphUnits at stage 3, else None
    forward: Any = None  # zero/stage3/graph_forward.GraphForward at stage 3, else None
    passes: tuple[str, ...] = ()  # DeepSpeed's names of the passes that run
    kept: frozenset[int] = field(default_factory=frozenset)  # units selective gather keeps from forward to backward
    freed: list[list[str]] = field(default_factory=list)  # free_activation: saved activations freed, per free call
    opt_offload: Any = None  # offload_opt_states: its deepcompile_offload.OptStateOffload
    param_home: Any = None  # offload_parameters: the host home it gave the shards (None: they had one)
    offloaded: list[dict[str, Any]] = field(default_factory=list)  # offload_activation: per graph, saved activations
    # (name, bytes) "moved" to the host and "kept"
    symmetric: list[Any] = field(default_factory=list)  # symmetric_memory: comm/symmetric.SymmetricGather per group


# DeepSpeed's pass names (``engine.compile(schedule=[(0, [names])])``); the ZeRO pass of the stage always runs
ZERO3_PASSES = ("zero3_compile", "prefetch", "selective_gather")
ZERO12_PASSES = ("zero1_compile", "zero2_compile")
# DeepSpeed's offload passes, by the key that turns each on; they run in place of prefetch and selective gather
OFFLOAD_PASSES = {"offload_opt_states": "offload_adam_states", "offload_parameters": "offload_parameters",
                  "offload_activation": "offload_activation"}


def _passes(schedule: Any, cfg: CompileConfig, stage3: bool) -> tuple[str, ...]:
    """The passes to run: DeepSpeed's default (all of the stage's) or a schedule naming them at step 0."""
    if cfg.passes is not None:
        wanted = "z3" if stage3 else "z1"
        bad = [p for p in cfg.passes if p in ("autosp", "autotp")]
        if bad:
            raise NotSupportedYetError("compile.passes", f"DeepCompile's {bad[0]} pass is not supported yet by zerospeed")
        if cfg.passes != [wanted]:
            raise ConfigError("compile.passes", f"{cfg.passes} does not match the ZeRO stage: use [\"{wanted}\"] (or "
                              "leave it unset)")
    offloads = tuple(name for key, name in OFFLOAD_PASSES.items() if getattr(cfg, key))
    if schedule is None and offloads:
        return ("zero3_compile", *offloads)
    if schedule is None:
        return ZERO3_PASSES if stage3 else ZERO12_PASSES
    known = ZERO3_PASSES if stage3 else ZERO12_PASSES
    if not isinstance(schedule, (list, tuple)) or not all(isinstance(e, (list, tuple)) and len(e) == 2 for e in schedule):
        raise ValueError(f"engine.compile(schedule=...) expects [(step, [pass names])], got {schedule!r}")
    if any(step != 0 for step, _ in schedule):
        raise NotImplementedError("engine.compile(schedule=...): passes at a step after 0 (DeepSpeed recompiles with "
                                  "profiled passes) are not supported yet by zerospeed, which plans its passes at "
                                  "compile time: list them at step 0")
    names = tuple(n for _, ns in schedule for n in ns)
    for n in names:
        if n not in known:
            raise ValueError(f"engine.compile(schedule=...): unknown DeepCompile pass {n!r} at this ZeRO stage "
                             f"(known: {', '.join(known)}; the offload passes are turned on by compile.offload_*)")
    return names + offloads


def _pass_backend(backend: Any, names: tuple[str, ...], numel_of: list[int], window: int,
                  cfg: CompileConfig, done: DeepCompiled) -> tuple[Any, dict[str, Any]]:
    """``backend`` with the ZeRO-3 graph passes on its forward and backward graphs; (backend, options).
    ``done.freed`` / ``done.offloaded`` receive the names of the activations ``free_activation`` frees in each
    backward graph / ``offload_activation`` moves to the host in each graph."""
    from ..zero.stage3.graph_free import add_free_activations, boxed
    from ..zero.stage3.graph_passes import run_passes

    debug = cfg.debug_log

    passes = tuple("release" if n == "zero3_compile" else n for n in names) + (("reduce",) if "zero3_compile" in names else ())

    def apply(graph: torch.fx.Graph) -> None:
        done = run_passes(graph, passes, numel_of, window)
        if debug:
            _log.info("DeepCompile passes %s changed %s; graph:\n%s", passes, done, graph)

    if backend == "aot_eager":
        from functorch.compile import min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        def fw_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            apply(gm.graph)
            return boxed(gm)  # the inputs die at their last use, not when the graph returns (graph_free.py)

        def bw_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            apply(gm.graph)
            if cfg.free_activation:
                mine = add_free_activations(gm.graph, cfg.free_activation_threshold)
                done.freed.extend(mine)
                _log.info("DeepCompile free_activation: %d saved activations of >= %d bytes freed after their "
                          "last use in backward", sum(map(len, mine)), cfg.free_activation_threshold)
            return boxed(gm, lazy_tangents=True)  # an output given no gradient costs no full zero (graph_free.py)

        # as torch's own aot_eager (the default partitioner fails on persistent parameters inside the checkpoint)
        partition = min_cut_rematerialization_partition
        if cfg.offload_activation:
            partition = _activation_offload(partition, done, cfg)
        return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, keep_inference_input_mutations=True,
                            partition_fn=partition), {}
    if cfg.offload_activation:
        raise NotSupportedYetError("compile.offload_activation", f"DeepCompile's offload_activation pass with the "
                                   f"{backend!r} backend is not supported yet by zerospeed (it rewrites the "
                                   "partitioned graphs of zerospeed's 'aot_eager' path): use backend='aot_eager'")
    if backend == "inductor":
        if cfg.free_activation:  # as in DeepSpeed (free_activation is off under inductor)
            _log.info("DeepCompile free_activation: inductor frees each saved activation after its last use "
                      "itself; no explicit frees are inserted")
        from torch._inductor.custom_graph_pass import CustomGraphPass

        class _Passes(CustomGraphPass):  # inductor's documented post-grad hook (config.post_grad_custom_post_pass)
            def __call__(self, graph: torch.fx.Graph) -> None:
                apply(graph)

            def uuid(self) -> Any:  # PASS_VERSION: a changed pass or op schema never reuses inductor's cached code
                return repr(("zerospeed-deepcompile", PASS_VERSION, passes, numel_of, window))

        return backend, {"options": {"post_grad_custom_post_pass": _Passes()}}
    warnings.warn(f"DeepCompile: the graph passes run with the 'aot_eager' and 'inductor' backends only; with "
                  f"{backend!r} the gathers stay at the top of the forward (no prefetch, release at the end of the "
                  "graph)", stacklevel=4)
    return backend, {}


def _activation_offload(partition: Any, done: DeepCompiled, cfg: CompileConfig) -> Any:
    """The partitioner followed by the offload_activation pass, planned against this rank's budget."""
    from ..zero.stage3.graph_offload import activation_budget, offload_partition

    acc = get_accelerator()
    budget, floor = activation_budget(acc.total_memory(), acc.memory_allocated())
    _log.info("DeepCompile offload_activation: budget %.3g bytes for saved activations, eligible from %d bytes",
              budget, floor)
    pin = cfg.offload_activation_pin_memory and can_pin_memory()  # pinned host copies exist on CUDA only
    return offload_partition(partition, done.graph.handle, budget, floor, pin, done.offloaded)


def _state_offloads(done: DeepCompiled, cfg: CompileConfig, zero3: Any, optimizer: Any) -> None:
    """offload_opt_states and offload_parameters (``deepcompile_offload.py``), set up on ``done``."""
    from .. import comm
    from .deepcompile_offload import OptStateOffload, home_shards

    if cfg.offload_opt_states:
        done.opt_offload = OptStateOffload(optimizer.optimizer)
        done.forward.before_forward.append(done.opt_offload.offload)
    if cfg.offload_parameters:
        done.param_home = home_shards(zero3.shards, comm.get_rank())
        _log.info("DeepCompile offload_parameters: %s", "the shards moved to a host home" if done.param_home
                  else "the shards already live in zero_optimization.offload_param's home")


def with_persistent(module: nn.Module, units: list[Any]) -> list[Any]:
    """Stage 3's units with the persistent (small, never partitioned) parameters added, each to the unit of the
    next module in ``named_modules()`` order that has one (else the last unit). Eager stage 3 leaves them out of
    its units (nothing to gather), but then under DeepCompile they would be inputs of the compiled graph whose
    gradients autograd delivers only after the whole backward: every norm and bias gradient at the end, and with
    them the bucket each sits in. In a unit, the graph op hands out a copy of the value (no collective) and its
    gradient goes to the reducer right after the node that makes it (``graph_passes.reduce_early``)."""
    from ..zero.stage3.fetcher import Unit
    from ..zero.stage3.param_store import shard_of

    by_name = {u.name: u for u in units}
    extra: dict[str, list[Any]] = {u.name: [] for u in units}
    waiting: list[Any] = []
    seen: set[int] = set()
    for name, m in module.named_modules():
        for p in m._parameters.values():
            s = shard_of(p) if p is not None else None
            if s is not None and s.persistent and id(s) not in seen:
                seen.add(id(s))
                waiting.append(s)
        unit = by_name.get(name or "<root>")
        if unit is not None and waiting:
            extra[unit.name].extend(waiting)
            waiting = []
    if waiting and units:
        extra[units[-1].name].extend(waiting)
    return [Unit(u.index, u.name, [*u.shards, *extra[u.name]]) for u in units]


def symmetric_gathers(cfg: CompileConfig, zero3: Any) -> list[Any]:
    """``compile.symmetric_memory`` at stage 3: every shard group's all-gathers go through CUDA symmetric memory
    (``comm/symmetric.py``), as DeepSpeed's DeepCompile gathers through its symmetric workspace. Refused, with
    the reason, where a group cannot have it (CPU/Gloo); below stage 3 there is no gather in the graph (a
    warning, as DeepSpeed reads the key only at stage 3)."""
    from .. import comm

    if not cfg.symmetric_memory:
        return []
    if zero3 is None:
        warnings.warn("compile.symmetric_memory has no effect below ZeRO stage 3: DeepCompile gathers no "
                      "parameters there (as in DeepSpeed, which reads it at stage 3 only)", stacklevel=3)
        return []
    groups = {id(s.group): (s.group, s.device, s.world) for s in zero3.shards}
    for group, device, _ in groups.values():
        reason = comm.symmetric.missing(group, device)
        if reason is not None:
            raise ConfigError("compile.symmetric_memory", f"DeepCompile's symmetric_memory gathers through CUDA "
                              f"symmetric memory (torch.distributed._symmetric_memory): {reason}. Set it to false")
    gathers = [comm.symmetric.enable(group, device) for group, device, world in groups.values() if world > 1]
    _log.info("DeepCompile symmetric_memory: %d group(s) gather through CUDA symmetric memory", len(gathers))
    return gathers


def sync_points(cfg: CompileConfig) -> frozenset[str]:
    """Where the graph ops synchronise the accelerator (``compile.sync_{before,after}_{allgather,reduce}``)."""
    points = {"before_allgather": cfg.sync_before_allgather, "after_allgather": cfg.sync_after_allgather,
              "before_reduce": cfg.sync_before_reduce, "after_reduce": cfg.sync_after_reduce}
    return frozenset(p for p, on in points.items() if on)


def deep_compile(module: nn.Module, backend: Any, compile_kwargs: dict[str, Any], cfg: CompileConfig,
                 zero3: Any = None, optimizer: Any = None, schedule: Any = None) -> DeepCompiled:
    """Compile ``module`` in place with DeepCompile; ``zero3``: its stage-3 runtime (None below stage 3),
    ``optimizer``: the ZeRO optimizer, whose reducer the graph's gradient hand-offs feed."""
    backend = get_accelerator().get_compile_backend() if backend is None else backend
    names = _passes(schedule, cfg, zero3 is not None)
    kwargs = {**compile_kwargs, "fullgraph": True}
    done_symmetric = symmetric_gathers(cfg, zero3)
    if zero3 is None:
        _log.info("DeepCompile below stage 3: the model compiles as one graph (backend=%s)", backend)
        module.compile(**kwargs, backend=backend)
        return DeepCompiled(passes=names)
    reducer = getattr(optimizer, "reducer", None)
    if reducer is None:
        raise ValueError("compile.deepcompile at ZeRO stage 3 needs an optimizer (its reducer takes the gradients)")
    from ..zero.stage3.graph_forward import GraphForward
    from ..zero.stage3.graph_ops import GraphUnits
    from ..zero.stage3.graph_passes import selective_units

    graph = GraphUnits(with_persistent(module, zero3.units), reducer.take_grad)
    graph.log = [] if cfg.debug_log else None
    graph.sync_points = sync_points(cfg)
    graph.synchronize = get_accelerator().synchronize
    numel_of = [sum(s.numel for s in shards) for shards in graph.units]
    fetcher = zero3.fetcher
    keep = frozenset(selective_units(numel_of, min(fetcher.max_live_numel, fetcher.max_reuse_numel))
                     if "selective_gather" in names else ())
    forward = GraphForward(module, graph, keep, lazy_tangents=backend == "aot_eager")
    done = DeepCompiled(graph, forward, names, keep)
    done.symmetric = done_symmetric
    compiled, options = _pass_backend(backend, names, numel_of, fetcher.prefetch_numel, cfg, done)
    _state_offloads(done, cfg, zero3, optimizer)
    zero3.remove_module_hooks()
    forward.run = torch.compile(forward.forward, **kwargs, backend=compiled, **options)
    module._compiled_call_impl = forward  # nn.Module.__call__ runs it (as nn.Module.compile does)
    _log.info("DeepCompile at stage 3: %d units gathered in the graph, %d kept for backward, passes %s (backend=%s)",
              len(graph.units), len(keep), names, backend)
    return done


__all__ = ["DeepCompiled", "deep_compile", "sync_points", "with_persistent"]
