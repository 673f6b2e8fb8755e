"""Partition a model for ZeRO-3 and install its hooks: what ``initialize()`` calls for stage 3.

Steps: cast parameters and buffers to the compute dtype on the device (already-partitioned ones, built
under ``zero.Init``, are cast shard by shard); make every rank start from rank 0's values (broadcast of
whole parameters and buffers; ``zero.Init`` already broadcast what it cut); cut every parameter larger
than ``stage3_param_persistence_threshold`` or, once the parameters kept whole so far reach
``stage3_model_persistence_threshold`` elements in all, any parameter that would exceed that total
(DeepSpeed's rule, in ``model.parameters()`` order); under parameter offload, hand each cut shard to its
home (host memory or a swap file; at world size 1 too, where a "shard" is the whole parameter); group
each module's directly-owned partitioned parameters into a unit; with ZeRO++ hpZ, give each cut shard its
node-sized group for a secondary partition; give the fetcher DeepSpeed's reuse
distance and a ``Lockstep`` (every gather checked to be the same on all ranks); install the module hooks.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from ... import comm
from ...config.errors import ConfigError, NotSupportedYetError
from ...config.zero import ZeroConfig
from ..grad_reducer import ReduceSettings
from .fetcher import Fetcher, Unit
from .group import Stage3Group, Stage3Reducer
from .hooks import HINT, install
from .leaves import apply_leaf_rules, granularity_leaves, z3_leaf_module
from .lockstep import Lockstep
from .mics import MicsGroups, mics_groups
from .qgz import LocoParams, QuantizedGradients
from .param_store import HpzGroup, ParamShard, ShardHome, ShardState, partition, shard_of

# Parameters to gather with a module although another module owns them (register_external_parameter).
_EXTERNAL: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The unit of each module of a model set up for stage 3 (for registrations made after setup).
_UNITS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_external_parameter(module: nn.Module, param: nn.Parameter) -> None:
    """Gather ``param`` whenever ``module`` runs, although another module owns it (e.g. a tied weight)."""
    _EXTERNAL.setdefault(module, []).append(param)
    unit = _UNITS.get(module)
    shard = shard_of(param)
    if unit is not None and shard is not None and not shard.persistent:
        unit.add(shard)


def _params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters())  # deduplicated: a tied parameter appears once


class _Persistence:
    """Which parameters stay whole: each at most ``param`` elements, all together at most ``model``."""

    def __init__(self, param: int, model: int, always: bool) -> None:
        self.param, self.model, self.always = param, model, always
        self.total = 0

    def __call__(self, numel: int) -> bool:
        if self.always:
            return True
        if numel > self.param or self.total + numel > self.model:
            return False
        self.total += numel
        return True


@torch.no_grad()
def _prepare(module: nn.Module, dtype: torch.dtype, device: torch.device, group: comm.Group | None,
             zcfg: ZeroConfig, home: ShardHome | None, group_of: dict[int, comm.Group] | None = None,
             mics: MicsGroups | None = None) -> list[ParamShard]:
    """``mics``: parameters broadcast over ``group`` but cut over the MiCS shard group."""
    world = comm.get_world_size(group if mics is None else mics.shard)
    persists = _Persistence(zcfg.stage3_param_persistence_threshold, zcfg.stage3_model_persistence_threshold,
                            always=world == 1 and home is None)
    shards = []
    for p in _params(module):
        state = shard_of(p)
        target = dtype if p.is_floating_point() or (state and state.dtype.is_floating_point) else None
        own = (group_of or {}).get(id(p), group)  # MoE experts: their expert-data-parallel group
        if state is not None:
            if mics is not None:
                raise NotSupportedYetError("zero_optimization.mics_shard_size", "MiCS with a model built under "
                                           "zero.Init is not supported yet by zerospeed: build it outside zero.Init")
            if own is not group and comm.get_world_size(own) != world:
                raise ValueError("a parameter with a partition group of its own (an MoE expert's) was partitioned "
                                 "by zero.Init over the whole data-parallel group: build the MoE layers outside "
                                 "zero.Init, or with ep_size 1")
            state.cast_(target or state.dtype, device)
            state.group = own  # zero.Init cut it on its group: gather on the engine's from now on
            if state.persistent:
                persists.total += state.numel
        else:
            p.data = p.data.to(device=device, dtype=target or p.dtype)
            comm.broadcast(p.data, src=comm.global_rank_of(own, 0), group=own)
            cut = mics.shard if mics is not None and own is group else own
            whole = comm.get_world_size(cut) == 1 and home is None  # nothing to cut it over
            state = partition(p, cut, persistent=whole or persists(p.numel()))
            if home is not None and not state.persistent:
                home.adopt(state)
        shards.append(state)
    for b in module.buffers():
        b.data = b.data.to(device=device)  # its dtype kept, as in DeepSpeed 0.19.8 (data_types.buffer_dtype)
        comm.broadcast(b.data, src=0, group=group)
    return shards


def _hpz_group(size: int, dp_group: comm.Group | None, home: ShardHome | None) -> HpzGroup | None:
    """ZeRO++ hpZ: the node-sized group of consecutive ranks that secondary partitions are cut over."""
    key = "zero_optimization.zero_hpz_partition_size"
    world = comm.get_world_size(dp_group)
    if size <= 1 or world == 1:
        return None
    if home is not None:
        raise NotSupportedYetError(key, "hpZ with parameter offload (offload_param) is not supported yet by zerospeed")
    if world != comm.get_world_size():
        raise NotSupportedYetError(key, "hpZ with model, pipeline or expert parallel groups (a data-parallel group "
                                   "smaller than the world) is not supported yet by zerospeed")
    if world % size:
        raise ConfigError(key, f"zero_hpz_partition_size {size} must divide the data-parallel world size {world}")
    if size == world:
        return None  # the secondary partition would be the primary one
    group = comm.intra_node_group(size)
    return HpzGroup(group, size, comm.get_rank(group))


def _qgz(enabled: bool, dp_group: comm.Group | None, loco: dict[str, Any] | None = None) -> QuantizedGradients | None:
    """ZeRO++ qgZ over the launcher's nodes (``LOCAL_WORLD_SIZE`` ranks each); one node: plain reduce-scatter.
    ``loco``: ``zeropp_loco_param`` (LoCo error feedback; used by qgZ only, as in DeepSpeed)."""
    world = comm.get_world_size(dp_group)
    if loco is not None and not enabled:
        warnings.warn("zeropp_loco_param has no effect without zero_quantized_gradients (LoCo compensates qgZ's "
                      "int4 gradients; as in DeepSpeed, it is ignored)", stacklevel=3)
    if not enabled or world == 1:
        return None
    if world != comm.get_world_size():
        raise NotSupportedYetError("zero_optimization.zero_quantized_gradients", "qgZ with model, pipeline or "
                                   "expert parallel groups is not supported yet by zerospeed")
    per_node = comm.ranks_per_node_from_env()
    if per_node >= world:
        warnings.warn("zero_quantized_gradients: all ranks are on one node (LOCAL_WORLD_SIZE = world size), so "
                      "gradients are reduce-scattered unquantised, as DeepSpeed does", stacklevel=3)
        return None
    return QuantizedGradients(comm.Hierarchy(per_node), dp_group, None if loco is None else LocoParams(**loco))


def _units(module: nn.Module, zcfg: ZeroConfig) -> list[tuple[nn.Module, Unit]]:
    """Each module that owns partitioned parameters and its unit, in ``named_modules()`` order.

    A module owns the parameters it holds directly (and any registered as external to it); a leaf module
    (``leaf_module``, ``set_z3_leaf_modules``, ``stage3_module_granularity_threshold``) owns every one in
    its subtree, and the modules below it own nothing (they get no hooks).
    """
    apply_leaf_rules(module, zcfg.leaf_module)
    granularity_leaves(module, zcfg.stage3_module_granularity_threshold)
    owners: list[tuple[nn.Module, Unit]] = []
    inside: set[int] = set()  # modules below a leaf
    for name, m in module.named_modules():
        if id(m) in inside:
            continue
        leaf = z3_leaf_module(m)
        if leaf:
            inside.update(id(c) for c in m.modules() if c is not m)
        params = m.parameters() if leaf else (p for p in m._parameters.values() if p is not None)
        subtree = m.modules() if leaf else (m,)
        owned = [shard_of(p) for p in params] + [shard_of(p) for sub in subtree for p in _EXTERNAL.get(sub, [])]
        mine = [s for s in dict.fromkeys(owned) if s is not None and not s.persistent]
        if mine:
            owners.append((m, Unit(len(owners), name or "<root>", mine)))
    return owners


class Stage3Runtime:
    """A model partitioned for stage 3: its shards, units, fetcher and hooks."""

    def __init__(self, module: nn.Module, zcfg: ZeroConfig, compute_dtype: torch.dtype, device: torch.device,
                 dp_group: comm.Group | None, param_home: ShardHome | None = None,
                 group_of: dict[int, comm.Group] | None = None) -> None:
        self.module = module
        self.dp_group = dp_group
        self.compute_dtype = compute_dtype
        self.device = device
        self.gather_16bit_on_save = zcfg.stage3_gather_16bit_weights_on_model_save
        self.param_home = param_home
        offloaded = param_home is not None or zcfg.offload_optimizer.device != "none"
        self.mics = mics_groups(zcfg.mics_shard_size, zcfg.mics_hierarchical_params_gather, dp_group, offloaded)
        self.shards = _prepare(module, compute_dtype, device, dp_group, zcfg, param_home, group_of, self.mics)
        for s in self.shards:  # ZeRO++ qwZ: int8 weight all-gathers (non-trainable ones under their own key)
            lossy = zcfg.zero_quantized_weights if s.param.requires_grad else zcfg.zero_quantized_nontrainable_weights
            s.quantize_gather = "int8" if lossy else False
            s.fetch_all_reduce = zcfg.stage3_use_all_reduce_for_fetch_params
            s.fetch_sequential = zcfg.stage3_allgather_sequential
            s.levels = None if self.mics is None else self.mics.hierarchy
            s.sanity_checks = zcfg.enable_sanity_checks
        if self.mics is not None and (zcfg.zero_hpz_partition_size > 1 or zcfg.zero_quantized_gradients):
            raise NotSupportedYetError("zero_optimization.mics_shard_size", "MiCS with ZeRO++ hpZ or qgZ is not "
                                       "supported yet by zerospeed")
        self.hpz = _hpz_group(zcfg.zero_hpz_partition_size, dp_group, param_home)
        self.qgz = _qgz(zcfg.zero_quantized_gradients, dp_group, zcfg.zeropp_loco_param)
        for s in self.shards:
            if not s.persistent:
                s.hpz = self.hpz
        owners = _units(module, zcfg)
        units = [unit for _, unit in owners]
        unit_of = {id(m): unit for m, unit in owners}
        self.units = units
        # A leaf's parameters may get gradients on some ranks only (the experts each rank routed to): a bucket
        # then fills at different moments per rank, so its reduce-scatter would interleave differently with
        # the gathers on the same group. Buckets are reduced after backward instead (overlap_comm off).
        self.uneven_grads = any(z3_leaf_module(m) for m, _ in owners)
        for m, unit in owners:
            _UNITS[m] = unit
        self.fetcher = Fetcher(units, self.shards, zcfg.stage3_prefetch_bucket_size, zcfg.stage3_max_live_parameters,
                               param_home, max_reuse_numel=zcfg.stage3_max_reuse_distance)
        self.fetcher.log_trace_warnings = zcfg.log_trace_cache_warnings
        names = {id(p): n for n, p in module.named_parameters()}
        self.lockstep = Lockstep(dp_group, self.shards, [names.get(id(s.param), "?") for s in self.shards],
                                 [u.name for u in units])
        self.fetcher.lockstep = self.lockstep
        for s in self.shards:
            s.lockstep = self.lockstep
        self.unit_of = unit_of
        self.module_hooks: list[RemovableHandle] = install(module, self.fetcher, unit_of)
        self.handles: list[RemovableHandle] = [*self.module_hooks,
                                               module.register_state_dict_pre_hook(self._check_state_dict)]

    def empty_partition_cache(self) -> None:
        """``engine.empty_partition_cache()``: release the gathered parameters nothing is using."""
        self.fetcher.release_unheld()

    def remove_module_hooks(self) -> None:
        """DeepCompile: the gathers become graph operations (``graph_forward.py``); the eager hooks go."""
        for h in self.module_hooks:
            h.remove()
        self.handles = [h for h in self.handles if h not in self.module_hooks]
        self.module_hooks.clear()

    @contextmanager
    def hooks_removed(self) -> Iterator[None]:
        """``unwrap_model_for_generation``: the module hooks off inside the block, the same ones back at exit
        (the recorded trace is kept: they come back on the same modules)."""
        self.remove_module_hooks()
        try:
            yield
        finally:
            self.module_hooks = install(self.module, self.fetcher, self.unit_of)
            self.handles.extend(self.module_hooks)

    def _check_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if any(s.state is not ShardState.GATHERED for s in self.shards):
            raise RuntimeError("state_dict() of a ZeRO-3 model would hold empty partitioned parameters; use "
                               "engine.save_16bit_model(), zerospeed.zero.full_state_dict(), or call it inside "
                               "zerospeed.zero.GatheredParameters(model.parameters()).\n" + HINT)

    # --- parts for initialize() ----------------------------------------------------------------------
    def make_group(self, params: list[nn.Parameter], options: dict[str, Any], rank: int,
                   bucket_numel: int, defer_master: bool = False, separate_master: bool = False,
                   group: comm.Group | None = None, comm_dtypes: Any = None) -> Stage3Group:
        """``group``: the one the params are partitioned over when not the data-parallel group (MoE experts).
        MiCS: the shard group, and this rank's place in it."""
        if group is None and self.mics is not None:
            group, rank = self.mics.shard, comm.get_rank(self.mics.shard)
        group = self.dp_group if group is None else group
        made = Stage3Group(params, options, comm.get_world_size(group), rank, bucket_numel,
                           self.compute_dtype, group, defer_master, separate_master, comm_dtypes)
        made.replica_group = self.mics.replicas if self.mics is not None and group is self.mics.shard else None
        return made

    def make_reducer(self, groups: list[Any], settings: ReduceSettings, group: comm.Group | None = None,
                     wiring: Any = None) -> Stage3Reducer:
        if self.qgz is not None and not settings.reduce_scatter:
            raise ConfigError("zero_optimization.zero_quantized_gradients", "qgZ replaces the gradient "
                              "reduce-scatter: it needs zero_optimization.reduce_scatter: true")
        qgz = self.qgz if group is None else None  # qgZ's node layout is the data-parallel group's (MoE experts: none)
        if self.uneven_grads and settings.overlap_comm:
            settings = dataclasses.replace(settings, overlap_comm=False)
        replicas = None
        if group is None and self.mics is not None:  # MiCS: reduce-scatter in the shard group, then across replicas
            group, replicas = self.mics.shard, self.mics.replicas
        return Stage3Reducer(groups, settings, self.dp_group if group is None else group, self.fetcher, qgz, wiring,
                             replicas)

    def check_checkpointable(self) -> None:
        """Checkpoints store each rank's partition by its place in the data-parallel group; MiCS's replicated
        partitions are not written that way yet (refused before anything is written, not saved wrong)."""
        if self.mics is not None and self.mics.replicas is not None:
            raise NotSupportedYetError("zero_optimization.mics_shard_size", "save_checkpoint with MiCS (a shard "
                                       "size smaller than the data-parallel world) is not supported yet by zerospeed; "
                                       "engine.save_16bit_model() and zerospeed.zero.full_state_dict() work")

    # --- accounting ----------------------------------------------------------------------------------
    def param_bytes(self) -> int:
        """Bytes of parameters this rank keeps between uses (shards, and whole persistent parameters).

        An fp32 shard that is a view of its optimizer master slot costs nothing extra (counted as master).
        """
        def kept(s: ParamShard) -> int:
            aliased = s.local is not None and s.local._base is not None
            return s.local_bytes() - (s.local.numel() * s.local.element_size() if aliased else 0)  # type: ignore[union-attr]

        return sum(kept(s) for s in self.shards)

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def setup_stage3(module: nn.Module, zcfg: ZeroConfig, compute_dtype: torch.dtype, device: torch.device,
                 dp_group: comm.Group | None, param_home: ShardHome | None = None,
                 group_of: dict[int, comm.Group] | None = None) -> Stage3Runtime:
    """``group_of``: ``id(param) -> group`` for parameters partitioned over another group than ``dp_group``
    (MoE experts over their expert-data-parallel group); broadcast from that group's first rank."""
    return Stage3Runtime(module, zcfg, compute_dtype, device, dp_group, param_home, group_of)


__all__ = ["Stage3Runtime", "register_external_parameter", "setup_stage3"]
