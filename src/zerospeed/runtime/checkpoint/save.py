"""``engine.save_checkpoint``: snapshot this rank's state, write it, commit atomically (see ``layout``)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import torch

from ... import comm
from . import agree, tiered
from .async_save import BackgroundWriter, SaveStats
from .channel import FailureChannel
from .errors import CheckpointError
from .part import RankSnapshot, SaveContext
from .state import rng_state, to_json
from .tensor_file import write_tensors
from . import layout, module_state
from .universal import names_by_id

logger = logging.getLogger(__name__)
CLIENT_FILE = "client_state.safetensors"
DEFAULT_COMMIT_TIMEOUT_S = 1800.0


def writer_of(engine: Any) -> BackgroundWriter:
    """The engine's own background writer (``EngineParts.checkpoint_writer``): one async save at a time."""
    return engine.checkpoint_writer


def save_group(engine: Any) -> Any:
    """The ranks that write one checkpoint: the data-parallel group, or every rank (tensor parallelism, a
    pipeline: ``EngineParts.checkpoint_group``)."""
    return engine.checkpoint_group or engine.dp_group


def snapshot(engine: Any, rank: int, world: int, client_state: dict[str, Any], copy: bool,
             exclude_frozen: bool = False) -> RankSnapshot:
    """Take the state to write: each of the engine's checkpoint parts (``part``) in order, then the module's
    entries. With ``copy`` every tensor is cloned to CPU (the async-save stall). ``exclude_frozen``:
    parameters with ``requires_grad=False`` are listed but not written (DeepSpeed's
    ``exclude_frozen_parameters``); a load keeps the values the model has for them."""
    ctx = SaveContext(engine, save_group(engine), names_by_id(engine.module), copy, exclude_frozen)
    snap = RankSnapshot(rank, world, module_rank=rank)
    for part in engine.checkpoint_parts:
        part.save(snap, ctx)
    snap.entries, snap.module_tensors = module_state.describe(engine.module, snap.grouped, snap.module_rank,
                                                              copy, exclude_frozen)
    metas = {part.name: part.meta(snap, ctx) for part in engine.checkpoint_parts}  # every rank: may gather
    snap.tensor_files[layout.shard_file(rank)] = snap.shard
    snap.json_files[layout.rng_file(rank)] = rng_state()
    if rank != 0:
        return snap
    client_tensors: dict[str, torch.Tensor] = {}
    client_json = to_json(dict(client_state or {}), "client_state", client_tensors)
    meta = {"format": layout.FORMAT, "version": layout.VERSION, "world_size": world,
            "zero_stage": engine.zero_optimization_stage(), "tensor_parallel_size": int(engine.mp_world_size),
            "compute_dtype": str(engine.compute_dtype).removeprefix("torch."),
            **{name: value for name, value in metas.items() if name}, "tensors": snap.entries,
            "client_state": client_json}
    snap.json_files[layout.META] = meta
    snap.tensor_files[layout.MODULE_FILE] = snap.module_tensors
    if client_tensors:
        snap.tensor_files[CLIENT_FILE] = client_tensors
    return snap


def write_snapshot(snap: RankSnapshot, staging: str, writer: Any = None) -> int:
    """Write this rank's files durably (``writer``: the ``checkpoint.writer`` section), then its marker;
    returns bytes written."""
    files: dict[str, dict[str, Any]] = {}
    for rel, tensors in snap.tensor_files.items():
        size, digest = write_tensors(os.path.join(staging, rel), tensors, {"format": "pt"}, writer)
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
    if engine.accumulating:
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
    if async_save and tiered.snapshot_fits(engine, group):
        return _save_async(engine, writer, rank, world, client_state, save_dir, tag, staging, save_latest, timeout, t0,
                           exclude_frozen, overwrite)
    error, nbytes, t1 = "", 0, time.perf_counter()
    try:
        snap = snapshot(engine, rank, world, client_state or {}, copy=False, exclude_frozen=exclude_frozen)
        t1 = time.perf_counter()
        nbytes = write_snapshot(snap, staging, engine.config.checkpoint.writer)
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
            tiered.retain(engine.config, save_dir)
        except Exception as exc:  # noqa: BLE001 - broadcast and raised on every rank below
            commit_error = f"{type(exc).__name__}: {exc}"
    commit_error = comm.broadcast_object(commit_error, src=0, group=group)
    if commit_error:
        raise CheckpointError(f"save_checkpoint({final!r}): rank 0 could not commit the checkpoint: {commit_error}")
    stats = SaveStats(final, stall_s=time.perf_counter() - t0, write_s=time.perf_counter() - t1, bytes=nbytes, done=True)
    writer.last = stats
    _statistics(engine, rank, stats)
    return stats


def _statistics(engine: Any, rank: int, stats: SaveStats) -> None:
    """``checkpoint.writer.show_statistics``: rank 0 logs what it wrote and how fast."""
    cfg = engine.config.checkpoint.writer
    if cfg is not None and cfg.show_statistics and rank == 0:
        rate = stats.bytes / stats.write_s / 1e9 if stats.write_s > 0 else 0.0
        logger.info("checkpoint %s: rank 0 wrote %d bytes in %.3f s (%.3f GB/s, writer %s)", stats.path,
                    stats.bytes, stats.write_s, rate, cfg.type)


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
            nbytes = write_snapshot(snap, staging, engine.config.checkpoint.writer)
        except Exception as exc:
            raise fail(exc) from exc
        if rank != 0:
            layout.wait_outcome(staging, timeout, channel=channel)
            return nbytes
        try:
            layout.commit(save_dir, tag, staging, layout.wait_markers(staging, world, timeout, channel=channel),
                          save_latest, overwrite)
            tiered.retain(engine.config, save_dir)
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
