"""``engine.save_checkpoint``: snapshot this rank's state, write it, commit atomically (see ``layout``)."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import comm
from . import agree
from .async_save import BackgroundWriter, SaveStats
from .channel import FailureChannel
from .errors import CheckpointError
from .state import param_group_options, rng_state, to_json
from .tensor_file import write_tensors
from . import layout, module_state
from .universal import names_by_id, snapshot_shards

CLIENT_FILE = "client_state.safetensors"
DEFAULT_COMMIT_TIMEOUT_S = 1800.0


def writer_of(engine: Any) -> BackgroundWriter:
    """The engine's own background writer (``EngineParts.checkpoint_writer``): one async save at a time."""
    return engine.checkpoint_writer


@dataclass
class RankSnapshot:
    """Everything one rank writes: tensor files (relpath -> tensors) and JSON files (relpath -> object)."""

    rank: int
    world: int
    tensor_files: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    json_files: dict[str, Any] = field(default_factory=dict)
    index: dict[str, list[int]] = field(default_factory=dict)


def save_group(engine: Any) -> Any:
    """The ranks that write one checkpoint: the data-parallel group, or every rank under tensor parallelism."""
    return getattr(engine, "checkpoint_group", None) or engine.dp_group


def _groups(engine: Any) -> list[Any]:
    return list(engine.optimizer.groups) if engine.optimizer is not None else []


def snapshot(engine: Any, rank: int, world: int, client_state: dict[str, Any], copy: bool,
             exclude_frozen: bool = False) -> RankSnapshot:
    """Take the state to write. With ``copy`` every tensor is cloned to CPU (the async-save stall).
    ``exclude_frozen``: parameters with ``requires_grad=False`` are listed but not written (DeepSpeed's
    ``exclude_frozen_parameters``); a load keeps the values the model has for them."""
    from ...parallel.tensor import checkpoint as tp_ckpt

    names = names_by_id(engine.module)
    groups = _groups(engine)
    opt = engine.optimizer.optimizer if engine.optimizer is not None else None
    stepper = getattr(engine.optimizer, "stepper", None)
    if stepper is not None:  # partial offload on an accelerator: device-held state into optimizer.state
        stepper.sync_for_checkpoint()
    dp_rank = comm.get_rank(engine.dp_group)
    tensors, ranges, opt_layout = snapshot_shards(groups, names, opt.state if opt is not None else None, copy, dp_rank)
    if save_group(engine) is not engine.dp_group:  # tensor parallelism: replicated tensors by the first tp rank
        if not tp_ckpt.writes_replicated(engine.module):
            tensors = {k: v for k, v in tensors.items() if k.rpartition("/")[2] != tp_ckpt.base_name(k.rpartition("/")[2])}
            ranges = {k: v for k, v in ranges.items() if k in tensors}
        for other in comm.all_gather_object(opt_layout, group=save_group(engine)):
            opt_layout.update(other)
    grouped = {tp_ckpt.base_name(names[id(p)]) for g in groups for p in g.params}
    if not exclude_frozen:  # MoE: frozen experts, per expert-data-parallel group (collective under ZeRO-3)
        frozen, frozen_ranges = module_state.frozen_experts(engine.module, grouped)
        tensors.update(frozen)
        ranges.update(frozen_ranges)
    snap = RankSnapshot(rank, world, index=ranges)
    snap.tensor_files[layout.shard_file(rank)] = tensors
    snap.json_files[layout.rng_file(rank)] = rng_state()
    entries, module_tensors = module_state.describe(engine.module, grouped, rank, copy, exclude_frozen)
    tp_ckpt.describe_split(engine.module, entries)
    if rank != 0:
        return snap
    client_tensors: dict[str, torch.Tensor] = {}
    client_json = to_json(dict(client_state or {}), "client_state", client_tensors)
    loader = engine.training_dataloader
    meta = {
        "format": layout.FORMAT, "version": layout.VERSION,
        "world_size": world, "zero_stage": engine.zero_optimization_stage(),
        "tensor_parallel_size": int(getattr(engine, "mp_world_size", 1)),
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
        "data_efficiency": None if engine.data_efficiency is None else
        to_json(engine.data_efficiency.state_dict(), "data_efficiency"),
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


def _check_accumulation(engine: Any) -> None:
    """Refuse to save gradients half-accumulated: they are not part of a checkpoint, and dropping them
    silently would make the resumed run differ from the uninterrupted one."""
    if getattr(engine, "_accumulating", False):
        gas = engine.gradient_accumulation_steps()
        raise CheckpointError(
            f"save_checkpoint called in the middle of a gradient accumulation (micro-step {engine.micro_steps} with "
            f"gradient_accumulation_steps={gas}): the partially accumulated gradients are not stored in a "
            "checkpoint. Save after the engine.step() that ends the accumulation "
            "(is_gradient_accumulation_boundary()).")


def save_checkpoint(engine: Any, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
                    save_latest: bool = True, async_save: bool = False, commit_timeout_s: float | None = None,
                    exclude_frozen: bool = False, overwrite: bool | None = None) -> SaveStats:
    """Collective over the engine's data-parallel group; see ``layout`` for the commit protocol and
    ``agree`` for what the ranks must agree on. A failure on any rank fails the save on every rank.
    ``overwrite``: see ``layout.check_overwrite`` (an existing tag keeps the files that are not zerospeed's)."""
    writer = writer_of(engine)
    writer.wait()
    _check_accumulation(engine)
    t0 = time.perf_counter()
    group = save_group(engine)
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    tag = layout.check_tag(f"global_step{engine.global_steps}" if tag is None else str(tag))
    save_dir = os.fspath(save_dir)
    tag, dirs = agree.agree_on_tag_and_dir(tag, save_dir, engine.config.checkpoint.tag_validation, group)
    begun: str | Exception = ""
    if rank == 0:
        try:
            layout.check_overwrite(save_dir, tag, overwrite)
            begun = os.path.basename(layout.begin(save_dir, tag))
        except (OSError, CheckpointError) as exc:
            begun = exc
    name = comm.broadcast_object(begun if isinstance(begun, str) else "", src=0, group=group)
    if not name:
        raise CheckpointError(f"save_checkpoint: rank 0 could not create the checkpoint in {dirs[0]}: {begun}"
                              if rank == 0 else f"save_checkpoint: rank 0 could not create the checkpoint in {dirs[0]}")
    try:
        agree.check_staging_visible(save_dir, name, dirs, group)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
        raise
    staging = os.path.join(save_dir, name)
    timeout = commit_timeout_s or DEFAULT_COMMIT_TIMEOUT_S
    final = os.path.join(save_dir, tag)
    if async_save:
        return _save_async(engine, writer, rank, world, client_state, save_dir, tag, staging, save_latest, timeout, t0,
                           exclude_frozen, overwrite)
    error, nbytes, t1 = "", 0, time.perf_counter()
    try:
        snap = snapshot(engine, rank, world, client_state or {}, copy=False, exclude_frozen=exclude_frozen)
        t1 = time.perf_counter()
        nbytes = write_snapshot(snap, staging)
    except Exception as exc:  # noqa: BLE001 - gathered and raised on every rank below
        error = f"{type(exc).__name__}: {exc}"
    try:
        agree.raise_if_any(error, group, f"save_checkpoint({final!r})",
                           f". Nothing was committed; '{layout.LATEST}' still names the previous checkpoint.")
    except CheckpointError:
        if rank == 0:  # every rank is done with the staging directory
            shutil.rmtree(staging, ignore_errors=True)
        raise
    commit_error = ""
    if rank == 0:
        try:
            layout.commit(save_dir, tag, staging, layout.wait_markers(staging, world, timeout), save_latest,
                          overwrite)
        except Exception as exc:  # noqa: BLE001 - broadcast and raised on every rank below
            commit_error = f"{type(exc).__name__}: {exc}"
    commit_error = comm.broadcast_object(commit_error, src=0, group=group)
    if commit_error:
        raise CheckpointError(f"save_checkpoint({final!r}): rank 0 could not commit the checkpoint: {commit_error}")
    stats = SaveStats(final, stall_s=time.perf_counter() - t0, write_s=time.perf_counter() - t1, bytes=nbytes, done=True)
    writer.last = stats
    return stats


def _save_async(engine: Any, writer: BackgroundWriter, rank: int, world: int, client_state: dict[str, Any] | None,
                save_dir: str, tag: str, staging: str, save_latest: bool, timeout: float, t0: float,
                exclude_frozen: bool = False, overwrite: bool | None = None) -> SaveStats:
    """Snapshot now; write, then (rank 0) commit or (others) wait for the outcome, in the writer thread.

    A failure on any rank is published into the staging directory and the world's key-value store
    (``channel``: a rank that cannot write to the directory still reaches it), so every rank's save fails within a
    poll interval (``wait_for_checkpoint`` / the next save re-raise it) and nothing is committed.
    """
    channel = FailureChannel(os.path.basename(staging))  # over the network too: the disk may be what failed

    def fail(exc: Exception) -> CheckpointError:
        error = f"{type(exc).__name__}: {exc}"
        channel.publish_failure(rank, error)
        layout.publish_failure(staging, rank, error)
        if rank == 0:
            channel.publish_outcome(f"rank 0: {error}")
            layout.write_outcome(staging, f"rank 0: {error}")
        return CheckpointError(f"checkpoint in {staging} was not committed ('latest' is unchanged): the write failed "
                               f"on rank {rank}: {error}")

    try:
        snap = snapshot(engine, rank, world, client_state or {}, copy=True, exclude_frozen=exclude_frozen)
    except Exception as exc:
        raise fail(exc) from exc
    stats = SaveStats(os.path.join(save_dir, tag), stall_s=0.0)

    def job() -> int:
        try:
            nbytes = write_snapshot(snap, staging)
        except Exception as exc:
            raise fail(exc) from exc
        if rank != 0:
            layout.wait_outcome(staging, timeout, channel=channel)
            return nbytes
        try:
            layout.commit(save_dir, tag, staging, layout.wait_markers(staging, world, timeout, channel=channel),
                          save_latest, overwrite)
        except Exception as exc:
            channel.publish_outcome(f"{type(exc).__name__}: {exc}")
            layout.write_outcome(staging, f"{type(exc).__name__}: {exc}")
            raise
        channel.publish_outcome(None)
        layout.write_outcome(staging, None)
        return nbytes

    writer.submit(job, stats)
    stats.stall_s = time.perf_counter() - t0
    return stats
