"""``engine.save_checkpoint``: snapshot this rank's state, write it, commit atomically (see ``layout``)."""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import comm
from .async_save import BackgroundWriter, SaveStats
from .state import param_group_options, rng_state, to_json
from .tensor_file import write_tensors
from . import layout, module_state
from .universal import names_by_id, snapshot_shards

CLIENT_FILE = "client_state.safetensors"
DEFAULT_COMMIT_TIMEOUT_S = 1800.0
_WRITERS: weakref.WeakKeyDictionary[Any, BackgroundWriter] = weakref.WeakKeyDictionary()


def writer_of(engine: Any) -> BackgroundWriter:
    if engine not in _WRITERS:
        _WRITERS[engine] = BackgroundWriter()
    return _WRITERS[engine]


@dataclass
class RankSnapshot:
    """Everything one rank writes: tensor files (relpath -> tensors) and JSON files (relpath -> object)."""

    rank: int
    world: int
    tensor_files: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    json_files: dict[str, Any] = field(default_factory=dict)
    index: dict[str, list[int]] = field(default_factory=dict)


def _groups(engine: Any) -> list[Any]:
    return list(engine.optimizer.groups) if engine.optimizer is not None else []


def snapshot(engine: Any, rank: int, world: int, client_state: dict[str, Any], copy: bool) -> RankSnapshot:
    """Take the state to write. With ``copy`` every tensor is cloned to CPU (the async-save stall)."""
    names = names_by_id(engine.module)
    groups = _groups(engine)
    opt = engine.optimizer.optimizer if engine.optimizer is not None else None
    tensors, ranges, opt_layout = snapshot_shards(groups, names, opt.state if opt is not None else None, copy, rank)
    snap = RankSnapshot(rank, world, index=ranges)
    snap.tensor_files[layout.shard_file(rank)] = tensors
    snap.json_files[layout.rng_file(rank)] = rng_state()
    grouped = {names[id(p)] for g in groups for p in g.params}
    entries, module_tensors = module_state.describe(engine.module, grouped, rank, copy)
    if rank != 0:
        return snap
    client_tensors: dict[str, torch.Tensor] = {}
    client_json = to_json(dict(client_state or {}), "client_state", client_tensors)
    loader = engine.training_dataloader
    meta = {
        "format": layout.FORMAT, "version": layout.VERSION,
        "world_size": world, "zero_stage": engine.zero_optimization_stage(),
        "compute_dtype": str(engine.compute_dtype).removeprefix("torch."),
        "tensors": entries,
        "optimizer": None if opt is None else {
            "type": type(opt).__name__, "param_groups": param_group_options(opt.param_groups), "layout": opt_layout,
            "loss_scaler": to_json(engine.optimizer.loss_scaler.state_dict(), "loss_scaler")},
        "lr_scheduler": None if engine.lr_scheduler is None else
        to_json(engine.lr_scheduler.state_dict(), "lr_scheduler"),
        "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                   "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
                   "gradient_accumulation_steps": engine.gradient_accumulation_steps()},
        "data": to_json(loader.state_dict(), "dataloader") if hasattr(loader, "state_dict") else None,
        "client_state": client_json,
    }
    snap.json_files[layout.META] = meta
    snap.tensor_files[layout.MODULE_FILE] = module_tensors
    if client_tensors:
        snap.tensor_files[CLIENT_FILE] = client_tensors
    return snap


def write_snapshot(snap: RankSnapshot, staging: str) -> int:
    """Write this rank's files durably, then its marker; returns bytes written."""
    files: dict[str, dict[str, Any]] = {}
    for rel, tensors in snap.tensor_files.items():
        size, digest = write_tensors(os.path.join(staging, rel), tensors, {"format": "pt"})
        files[rel] = {"bytes": size, "sha256": digest}
    for rel, obj in snap.json_files.items():
        size, digest = layout.write_json(os.path.join(staging, rel), obj)
        files[rel] = {"bytes": size, "sha256": digest}
    for sub in ("", "shards", "rng"):
        layout.fsync_dir(os.path.join(staging, sub))
    layout.publish_marker(staging, snap.rank, files, snap.index)
    return sum(f["bytes"] for f in files.values())


def save_checkpoint(engine: Any, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
                    save_latest: bool = True, async_save: bool = False, commit_timeout_s: float | None = None) -> SaveStats:
    """Collective over the engine's data-parallel group; see ``layout`` for the commit protocol."""
    writer = writer_of(engine)
    writer.wait()
    t0 = time.perf_counter()
    group = engine.dp_group
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    tag = layout.check_tag(f"global_step{engine.global_steps}" if tag is None else str(tag))
    tags = comm.all_gather_object(tag, group=group)
    if len(set(tags)) != 1:
        raise ValueError(f"save_checkpoint: ranks passed different tags {tags}; every rank must pass the same tag")
    save_dir = os.fspath(save_dir)
    staging = comm.broadcast_object(layout.begin(save_dir, tag) if rank == 0 else None, src=0, group=group)
    timeout = commit_timeout_s or DEFAULT_COMMIT_TIMEOUT_S
    final = os.path.join(save_dir, tag)
    if async_save:
        snap = snapshot(engine, rank, world, client_state or {}, copy=True)
        stats = SaveStats(final, stall_s=0.0)

        def job() -> int:
            nbytes = write_snapshot(snap, staging)
            if rank == 0:
                layout.commit(save_dir, tag, staging, layout.wait_markers(staging, world, timeout), save_latest)
            return nbytes

        writer.submit(job, stats)
        stats.stall_s = time.perf_counter() - t0
        return stats
    snap = snapshot(engine, rank, world, client_state or {}, copy=False)
    t1 = time.perf_counter()
    nbytes = write_snapshot(snap, staging)
    comm.barrier(group)
    if rank == 0:
        layout.commit(save_dir, tag, staging, layout.wait_markers(staging, world, timeout), save_latest)
    comm.barrier(group)
    stats = SaveStats(final, stall_s=time.perf_counter() - t0, write_s=time.perf_counter() - t1, bytes=nbytes, done=True)
    writer.last = stats
    return stats
