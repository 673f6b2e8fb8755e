"""Pipeline checkpoints: the universal (per-parameter, reshardable) format, written by every stage at once.

A PipelineModule names its parameters by *global layer index* (``"3.attn.c_attn.weight"``) and tied modules
by key (``"tied_modules.embed.wte.weight"``), whatever the number of stages, so layer i's tensors are
addressable by layer index exactly as in DeepSpeed's ``layer_XX-model_states`` layout. Each rank writes the
elements it owns (ZeRO-1 shard over its data-parallel group) of its own layers' fp32 master and optimizer
state into ``shards/rank_NNNNN``; a tied weight is written once (by the first stage holding it). Global
rank 0 writes the merged metadata. Loading reads each parameter by name, so a checkpoint saved at pp=2 x dp=2
loads at pp=2 x dp=2 (bitwise), at pp=4, at pp=1, into a plain model (``zerospeed to-fp32`` exports it), and
the reverse. Same files, manifest, atomic commit and ``latest`` pointer as the data-parallel checkpoint, and
the same async save (snapshot now, write and commit in a background thread, no collectives there).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ... import comm
from ...runtime.checkpoint import layout, module_state
from ...runtime.checkpoint.errors import CheckpointError
from ...runtime.checkpoint.load import _load_training_state, open_checkpoint
from ...runtime.checkpoint.async_save import SaveStats
from ...runtime.checkpoint.save import CLIENT_FILE, RankSnapshot, write_snapshot, writer_of
from ...runtime.checkpoint.state import from_json, param_group_options, rng_state, set_rng_state, to_json
from ...runtime.checkpoint.tensor_file import TensorReader
from ...runtime.checkpoint.universal import CheckpointReader, load_optimizer_state, load_params, names_by_id, \
    snapshot_shards

DEFAULT_COMMIT_TIMEOUT_S = 1800.0


def _param_name(key: str) -> str:
    kind, rest = key.split("/", 1)
    return rest if kind == "master" else rest.split("/", 1)[1]


def _replicated_names(engine: Any) -> set[str]:
    names = names_by_id(engine.module)
    return {names[id(p)] for p in engine.module.parameters() if id(p) in engine.module.replicated}


def _no_tensor_parallel(engine: Any) -> None:
    if getattr(engine, "tensor_parallel", None) is not None:
        from ...config.errors import NotSupportedYetError

        raise NotSupportedYetError("tensor_parallel", "checkpoints of a pipeline with tensor parallelism are not "
                                   "supported yet by zerospeed")


def save_pipeline_checkpoint(engine: Any, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
                             save_latest: bool = True, commit_timeout_s: float | None = None,
                             async_save: bool = False) -> str:
    """Collective over every rank of the job; returns the checkpoint directory. ``async_save``: snapshot
    (CPU copies) now, write and commit in the engine's background writer (``wait_for_checkpoint``)."""
    writer = writer_of(engine)
    writer.wait()  # at most one save in flight; re-raises the previous one's error
    _no_tensor_parallel(engine)
    world = comm.world_group()
    grank, gworld = comm.get_rank(world), comm.get_world_size(world)
    tag = layout.check_tag(f"global_step{engine.global_steps}" if tag is None else str(tag))
    tags = comm.all_gather_object(tag, group=world)
    if len(set(tags)) != 1:
        raise ValueError(f"save_checkpoint: ranks passed different tags {tags}; every rank must pass the same tag")
    save_dir = os.fspath(save_dir)
    staging = comm.broadcast_object(layout.begin(save_dir, tag) if grank == 0 else None, src=0, group=world)
    module, grid = engine.module, engine.grid
    dp_rank = grid.get_data_parallel_rank()
    names = names_by_id(module)
    groups = list(engine.optimizer.groups) if engine.optimizer is not None else []
    opt = engine.optimizer.optimizer if engine.optimizer is not None else None
    if getattr(engine.optimizer, "stepper", None) is not None:  # partial offload / ZenFlow: their state in opt.state
        engine.optimizer.stepper.sync_for_checkpoint()
    tensors, ranges, opt_layout = snapshot_shards(groups, names, opt.state if opt is not None else None, async_save,
                                                  dp_rank)
    skip = _replicated_names(engine)  # tied copies: the first stage holding the tie writes them
    tensors = {k: v for k, v in tensors.items() if _param_name(k) not in skip}
    ranges = {k: v for k, v in ranges.items() if _param_name(k) not in skip}
    opt_layout = {k: v for k, v in opt_layout.items() if k not in skip}
    grouped = {names[id(p)] for g in groups for p in g.params}
    frozen, frozen_ranges = module_state.frozen_experts(module, grouped)  # MoE: per expert-data group
    tensors.update(frozen)
    ranges.update(frozen_ranges)
    entries, module_tensors = module_state.describe(module, grouped, dp_rank, copy=True)
    module_tensors = {k: v for k, v in module_tensors.items() if k not in skip}
    gathered = comm.all_gather_object((entries, opt_layout, module_tensors), group=world)
    snap = RankSnapshot(grank, gworld, index=ranges)
    snap.tensor_files[layout.shard_file(grank)] = tensors
    snap.json_files[layout.rng_file(grank)] = rng_state()
    if grank == 0:
        all_entries: dict[str, Any] = {}
        all_layout: dict[str, Any] = {}
        all_module: dict[str, torch.Tensor] = {}
        for e, lay, mt in gathered:
            all_entries.update(e)
            all_layout.update(lay)
            all_module.update(mt)
        _rank0_files(engine, snap, all_entries, all_layout, all_module, client_state or {}, gworld, opt)
    timeout = commit_timeout_s or DEFAULT_COMMIT_TIMEOUT_S
    if async_save:
        writer.submit(_async_job(snap, staging, save_dir, tag, save_latest, timeout), SaveStats(os.path.join(
            save_dir, tag), stall_s=0.0))
        return os.path.join(save_dir, tag)
    write_snapshot(snap, staging)
    comm.barrier(world)
    if grank == 0:
        markers = layout.wait_markers(staging, gworld, timeout)
        layout.commit(save_dir, tag, staging, markers, save_latest)
    comm.barrier(world)
    return os.path.join(save_dir, tag)


def _async_job(snap: RankSnapshot, staging: str, save_dir: str, tag: str, save_latest: bool,
               timeout: float) -> Callable[[], int]:
    """The writer thread's part (no collectives): write; rank 0 waits for every marker and commits, the
    others wait for its outcome. A failure is published in the staging directory, so every rank's save fails."""
    def job() -> int:
        try:
            nbytes = write_snapshot(snap, staging)
        except Exception as exc:
            layout.publish_failure(staging, snap.rank, f"{type(exc).__name__}: {exc}")
            if snap.rank == 0:
                layout.write_outcome(staging, f"rank 0: {type(exc).__name__}: {exc}")
            raise CheckpointError(f"checkpoint in {staging} was not committed ('latest' is unchanged): the write "
                                  f"failed on rank {snap.rank}: {exc}") from exc
        if snap.rank != 0:
            layout.wait_outcome(staging, timeout)
            return nbytes
        try:
            layout.commit(save_dir, tag, staging, layout.wait_markers(staging, snap.world, timeout), save_latest)
        except Exception as exc:
            layout.write_outcome(staging, f"{type(exc).__name__}: {exc}")
            raise
        layout.write_outcome(staging, None)
        return nbytes

    return job


def _rank0_files(engine: Any, snap: RankSnapshot, entries: dict[str, Any], opt_layout: dict[str, Any],
                 module_tensors: dict[str, torch.Tensor], client_state: dict[str, Any], world: int, opt: Any) -> None:
    client_tensors: dict[str, torch.Tensor] = {}
    loader = engine.training_dataloader
    grid = engine.grid
    snap.json_files[layout.META] = {
        "format": layout.FORMAT, "version": layout.VERSION,
        "world_size": world, "zero_stage": engine.zero_optimization_stage(),
        "compute_dtype": str(engine.compute_dtype).removeprefix("torch."),
        "pipeline": {"stages": grid.get_pipe_parallel_world_size(), "data_parallel": grid.get_data_parallel_world_size(),
                     "parts": engine.module.partitions(), "virtual_stages": engine.module.virtual_stages},
        "tensors": entries,
        "optimizer": None if opt is None else {
            "type": type(opt).__name__, "param_groups": param_group_options(opt.param_groups), "layout": opt_layout,
            "loss_scaler": to_json(engine.optimizer.loss_scaler.state_dict(), "loss_scaler")},
        "lr_scheduler": None if engine.lr_scheduler is None else to_json(engine.lr_scheduler.state_dict(),
                                                                         "lr_scheduler"),
        "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                   "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
                   "gradient_accumulation_steps": engine.gradient_accumulation_steps()},
        "data": to_json(loader.state_dict(), "dataloader") if hasattr(loader, "state_dict") else None,
        "client_state": to_json(dict(client_state), "client_state", client_tensors),
    }
    snap.tensor_files[layout.MODULE_FILE] = module_tensors
    if client_tensors:
        snap.tensor_files[CLIENT_FILE] = client_tensors


def load_pipeline_checkpoint(engine: Any, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                             load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                             load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
    """Collective over every rank; each rank reads its own layers by name (any saved pipeline degree)."""
    _no_tensor_parallel(engine)
    writer_of(engine).wait()  # an async save of this engine first lands
    world = comm.world_group()
    opened = open_checkpoint(load_dir, tag, world)
    if opened is None:
        return None, None
    ckpt, _, meta, index = opened
    module = engine.module
    current = {k: module_state.full_shape(t) for k, t in module_state.entries(module)}
    missing = [k for k in current if k not in meta["tensors"]]
    if missing and load_module_strict:
        raise CheckpointError(f"checkpoint does not hold this stage's tensors {missing[:10]} (saved from another "
                              "model? pass load_module_strict=False to load the rest)")
    for k, shape in current.items():
        if k in meta["tensors"] and list(shape) != meta["tensors"][k]["shape"]:
            raise CheckpointError(f"checkpoint tensor {k!r} has shape {meta['tensors'][k]['shape']}, the model has "
                                  f"{list(shape)}")
    names = names_by_id(module)
    groups = list(engine.optimizer.groups) if engine.optimizer is not None else []
    grouped = {names[id(p)] for g in groups for p in g.params}
    reader = CheckpointReader(ckpt, index)
    try:
        load_params(groups, names, reader)
        module_state.load_rest(module, grouped, meta["tensors"], os.path.join(ckpt, layout.MODULE_FILE), reader)
        if not load_module_only:
            _load_training_state(engine, meta, reader, names, load_optimizer_states, load_lr_scheduler_states)
            saved = meta.get("pipeline", {})
            same = (saved.get("stages"), saved.get("data_parallel")) == (
                engine.grid.get_pipe_parallel_world_size(), engine.grid.get_data_parallel_world_size())
            rng_path = os.path.join(ckpt, layout.rng_file(comm.get_rank(world)))
            if same and os.path.isfile(rng_path):
                set_rng_state(layout.read_json(rng_path))
    finally:
        reader.close()
    client_tensors: dict[str, torch.Tensor] = {}
    if os.path.isfile(os.path.join(ckpt, CLIENT_FILE)):
        with TensorReader(os.path.join(ckpt, CLIENT_FILE)) as cf:
            client_tensors = {k: cf.read(k) for k in cf.keys()}
    return ckpt, from_json(meta.get("client_state") or {}, client_tensors)
