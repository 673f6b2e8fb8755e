"""The engine's checkpoint parts (``part.CheckpointPart``): each says what one engine part writes and reads.

Built by ``runtime/build_checkpoint.py`` in save order: the offload stepper first (its device-held state
into ``optimizer.state``), the ZeRO groups, then the parallelisms that change who writes what (tensor
parallelism, the pipeline stage, MoE's frozen experts), then the schedule, counters, data loader and data
efficiency. Where a parallelism names tensors differently it says so here, through its own checkpoint
module (``parallel/tensor/checkpoint.py``, ``parallel/expert/checkpoint.py``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from torch import nn

from ... import comm
from ...parallel.tensor import checkpoint as tp_ckpt
from ...precision import NoScaler
from . import module_state, staged
from .errors import CheckpointError
from .part import LoadContext, Part, RankSnapshot, SaveContext
from .state import param_group_options, restore_param_group_options, to_json
from .universal import load_optimizer_state, snapshot_shards


class OffloadPart(Part):
    """ZeRO-Offload's stepper and ZenFlow: partial offload keeps some state on the device; it goes into
    ``optimizer.state`` before the ZeRO groups are written (loading writes ``optimizer.state``, which the
    stepper reads)."""

    def __init__(self, stepper: Any) -> None:
        self.stepper = stepper

    def save(self, snap: RankSnapshot, ctx: SaveContext) -> None:
        self.stepper.sync_for_checkpoint()


class ZeroGroupsPart(Part):
    """The ZeRO groups: this rank's fp32 master elements and element-wise optimizer state (``universal``),
    the optimizer's param-group options and the loss scaler; the top-k warm-up's optimizer-step count."""

    name = "optimizer"

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer  # the ZeroOptimizer, or None (no optimizer: nothing but the module)

    def groups(self) -> list[Any]:
        return list(self.optimizer.groups) if self.optimizer is not None else []

    def save(self, snap: RankSnapshot, ctx: SaveContext) -> None:
        opt = self.optimizer.optimizer if self.optimizer is not None else None
        dp_rank = comm.get_rank(ctx.engine.dp_group)
        snap.shard, snap.index, snap.opt_layout = snapshot_shards(
            self.groups(), ctx.names, opt.state if opt is not None else None, ctx.copy, dp_rank)
        snap.grouped = {ctx.names[id(p)] for g in self.groups() for p in g.params}

    def meta(self, snap: RankSnapshot, ctx: SaveContext) -> Any:
        if self.optimizer is None:
            return None
        opt = self.optimizer.optimizer
        return {"type": type(opt).__name__, "param_groups": param_group_options(opt.param_groups),
                "layout": snap.opt_layout,  # the same dict: a pipeline stage merges the other stages' into it
                "loss_scaler": to_json(self.optimizer.loss_scaler.state_dict(), "loss_scaler")}

    def check(self, saved: Any, ctx: LoadContext) -> None:
        if ctx.module_only or not ctx.load_optimizer_states or self.optimizer is None or saved is None:
            return
        ctx.layout = tp_ckpt.remap_layout(saved["layout"], ctx.names)
        here = len(self.optimizer.optimizer.param_groups)
        if len(saved["param_groups"]) != here:
            raise CheckpointError(f"{os.path.join(ctx.ckpt, 'meta.json')}: field 'optimizer.param_groups' has "
                                  f"{len(saved['param_groups'])} groups, the engine's optimizer {here}")

    def load(self, saved: Any, ctx: LoadContext) -> None:
        if self.optimizer is None:
            return
        if saved is not None and ctx.load_optimizer_states:
            opt = self.optimizer.optimizer
            if saved["type"] != type(opt).__name__:
                warnings.warn(f"checkpoint optimizer is {saved['type']}, the engine's is {type(opt).__name__}; "
                              "loading its state by name anyway", stacklevel=5)
            restore_param_group_options(opt.param_groups, saved["param_groups"])
            if not ctx.optimizer_state_loaded:  # (pipeline_loading_checkpoint: in the rank's turn)
                load_optimizer_state(self.groups(), ctx.names, ctx.reader,
                                     tp_ckpt.remap_layout(saved["layout"], ctx.names), opt)
            if not isinstance(self.optimizer.loss_scaler, NoScaler):  # bf16/fp32 keep scale 1 whatever was saved
                self.optimizer.loss_scaler.load_state_dict(saved["loss_scaler"])
        counters = ctx.meta["engine"]  # the top-k warm-up counts optimizer steps taken
        self.optimizer.set_compression_steps(int(counters["global_steps"]) - int(counters["skipped_steps"]))


class SchedulerPart(Part):
    name = "lr_scheduler"

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def meta(self, snap: RankSnapshot, ctx: SaveContext) -> Any:
        return None if self.scheduler is None else to_json(self.scheduler.state_dict(), "lr_scheduler")

    def load(self, saved: Any, ctx: LoadContext) -> None:
        if ctx.load_lr_scheduler_states and self.scheduler is not None and saved is not None:
            self.scheduler.load_state_dict(saved)


class CountersPart(Part):
    """The engine's step, sample and micro-step counters (and the accumulation they were counted in)."""

    name = "engine"

    def meta(self, snap: RankSnapshot, ctx: SaveContext) -> Any:
        e = ctx.engine
        return {"global_steps": e.global_steps, "global_samples": e.global_samples, "micro_steps": e.micro_steps,
                "skipped_steps": e.skipped_steps, "gradient_accumulation_steps": e.gradient_accumulation_steps()}

    def check(self, saved: Any, ctx: LoadContext) -> None:
        if not ctx.module_only:
            staged.check_counters(saved, os.path.join(ctx.ckpt, "meta.json"))

    def load(self, saved: Any, ctx: LoadContext) -> None:
        e = ctx.engine
        e.global_steps = int(saved["global_steps"])
        e.global_samples = int(saved["global_samples"])
        gas = int(saved.get("gradient_accumulation_steps", e.gradient_accumulation_steps()))
        if gas == e.gradient_accumulation_steps():
            e.micro_steps = int(saved["micro_steps"])
        else:  # another world size or accumulation: count micro-steps in the new unit, from a step boundary
            if int(saved["micro_steps"]) % gas:
                warnings.warn("the checkpoint was saved in the middle of a gradient accumulation; its partial "
                              "gradients are not stored, the next step starts a fresh accumulation", stacklevel=5)
            e.micro_steps = e.global_steps * e.gradient_accumulation_steps()
        e.skipped_steps = int(saved["skipped_steps"])


class LoaderPart(Part):
    """The training loader's position (a loader with ``state_dict``, such as DeepSpeed's curriculum sampler)."""

    name = "data"

    def __init__(self, loader: Any, saves: bool, loads: bool) -> None:
        self.loader, self.saves, self.loads = loader, saves, loads

    def meta(self, snap: RankSnapshot, ctx: SaveContext) -> Any:
        return to_json(self.loader.state_dict(), "dataloader") if self.saves else None

    def load(self, saved: Any, ctx: LoadContext) -> None:
        if saved is not None and self.loads:
            self.loader.load_state_dict(saved)


class DataEfficiencyPart(Part):
    """Curriculum / progressive layer drop / random-LTD schedules (``data_pipeline.runtime.DataEfficiency``)."""

    name = "data_efficiency"

    def __init__(self, data_efficiency: Any) -> None:
        self.data_efficiency = data_efficiency

    def meta(self, snap: RankSnapshot, ctx: SaveContext) -> Any:
        de = self.data_efficiency
        return None if de is None else to_json(de.state_dict(), "data_efficiency")

    def load(self, saved: Any, ctx: LoadContext) -> None:
        if saved is not None and self.data_efficiency is not None:
            self.data_efficiency.load_state_dict(saved)


class CompressionPart(Part):
    """compression_training / MoQ: the schedule's position (``compression/runtime.py``'s ``state_dict``); the
    masks, learned scores and activation ranges are module tensors. DeepSpeed kept none of it (a resumed run
    restarted every ``schedule_offset`` and MoQ's bits from step 0)."""

    name = "compression"

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime  # a CompressionRuntime

    def meta(self, snap: RankSnapshot, ctx: SaveContext) -> Any:
        return to_json(self.runtime.state_dict(), "compression")

    def check(self, saved: Any, ctx: LoadContext) -> None:
        if ctx.module_only or saved is None:
            return
        why = self.runtime.check_state(saved)
        if why:
            raise CheckpointError(f"{os.path.join(ctx.ckpt, 'meta.json')}: field 'compression' cannot be loaded: {why}")

    def load(self, saved: Any, ctx: LoadContext) -> None:
        if ctx.module_only:
            return
        if saved is None:
            warnings.warn("the checkpoint holds no compression state (saved without compression_training or "
                          "quantize_training): the compression schedule goes on from this engine's step "
                          f"{self.runtime.scheduler.training_steps}", stacklevel=5)
            return
        self.runtime.load_state_dict(saved)


class TensorParallelPart(Part):
    """AutoTP: split parameters saved per shard (``name@tp<r>of<T>``), replicated ones by the first
    tensor-parallel rank, expert parameters (AutoEP folding) by every rank that owns them; every rank's optimizer layout merged; the split layout described in the entries."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def save(self, snap: RankSnapshot, ctx: SaveContext) -> None:
        if not tp_ckpt.writes_replicated(self.module):  # its shards, and its experts (AutoEP folding: not replicas)
            experts = {n for n, p in self.module.named_parameters() if getattr(p, "allreduce", True) is False}
            snap.shard = {k: v for k, v in snap.shard.items() if (n := k.rpartition("/")[2]) != tp_ckpt.base_name(n)
                          or n in experts}
            snap.index = {k: v for k, v in snap.index.items() if k in snap.shard}
        for other in comm.all_gather_object(snap.opt_layout, group=ctx.group):
            snap.opt_layout.update(other)
        snap.grouped = {tp_ckpt.base_name(n) for n in snap.grouped}

    def meta(self, snap: RankSnapshot, ctx: SaveContext) -> Any:
        tp_ckpt.describe_split(self.module, snap.entries)

    def check(self, saved: Any, ctx: LoadContext) -> None:
        ctx.grouped = {tp_ckpt.base_name(n) for n in ctx.grouped}


class ExpertsPart(Part):
    """MoE: frozen expert parameters differ between expert-parallel ranks, so the first rank of each
    expert-data-parallel group writes its own experts' (``module_state.frozen_experts``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def save(self, snap: RankSnapshot, ctx: SaveContext) -> None:
        if ctx.exclude_frozen:
            return
        frozen, ranges = module_state.frozen_experts(self.module, snap.grouped)  # collective under ZeRO-3
        snap.shard.update(frozen)
        snap.index.update(ranges)


class PipelineStagePart(Part):
    """A pipeline stage writes its own layers: tied copies once (by the first stage holding the tie), its
    module tensors by its data-parallel rank 0; the stages' entries, optimizer layouts and module tensors
    are merged for rank 0's metadata. On load the stage reads its own layers by name (any saved degree);
    RNG states come back only at the same pipeline and data-parallel degrees."""

    name = "pipeline"

    def __init__(self, module: Any, refused: str = "", parallel_write: bool = False) -> None:
        self.module, self.grid, self.refused = module, module.mpu(), refused
        self.parallel_write = parallel_write  # checkpoint.parallel_write.pipeline_stage

    def _refuse(self) -> None:
        if self.refused:
            from ...config.errors import NotSupportedYetError

            raise NotSupportedYetError("tensor_parallel", self.refused)

    def _skip(self, names: dict[int, str]) -> set[str]:
        return {names[id(p)] for p in self.module.parameters() if id(p) in self.module.replicated}

    def save(self, snap: RankSnapshot, ctx: SaveContext) -> None:
        self._refuse()
        skip = self._skip(ctx.names)
        snap.shard = {k: v for k, v in snap.shard.items() if _param_name(k) not in skip}
        snap.index = {k: v for k, v in snap.index.items() if _param_name(k) not in skip}
        snap.opt_layout = {k: v for k, v in snap.opt_layout.items() if k not in skip}
        snap.module_rank = 0 if self.parallel_write else self.grid.get_data_parallel_rank()

    def meta(self, snap: RankSnapshot, ctx: SaveContext) -> Any:
        skip = self._skip(ctx.names)
        mine = {k: v for k, v in snap.module_tensors.items() if k not in skip}
        snap.module_tensors = {}
        if self.parallel_write:  # this rank's share of its stage's module tensors, in its own shard file
            keys = sorted(mine)
            dp, dp_size = self.grid.get_data_parallel_rank(), self.grid.get_data_parallel_world_size()
            for key in keys[dp::dp_size]:
                snap.shard[f"module/{key}"] = mine[key].reshape(-1)
                snap.index[f"module/{key}"] = [0, mine[key].numel()]
            mine = {}
        for entries, lay, tensors in comm.all_gather_object((snap.entries, snap.opt_layout, mine), group=ctx.group):
            snap.entries.update(entries)
            snap.opt_layout.update(lay)
            snap.module_tensors.update(tensors)
        return {"stages": self.grid.get_pipe_parallel_world_size(),
                "data_parallel": self.grid.get_data_parallel_world_size(),
                "parts": self.module.partitions(), "virtual_stages": self.module.virtual_stages}

    def check(self, saved: Any, ctx: LoadContext) -> None:
        self._refuse()
        ctx.partial_model = True
        same = isinstance(saved, dict) and (saved.get("stages"), saved.get("data_parallel")) == (
            self.grid.get_pipe_parallel_world_size(), self.grid.get_data_parallel_world_size())
        if not same:
            ctx.rng = None


def _param_name(key: str) -> str:
    kind, rest = key.split("/", 1)
    return rest if kind == "master" else rest.split("/", 1)[1]
