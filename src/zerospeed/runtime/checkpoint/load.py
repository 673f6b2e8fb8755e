"""``engine.load_checkpoint``: verify the manifest, then rebuild every part of the state at this world size.

Verification is shared out: rank r hashes every M-th file (M ranks), then the ranks agree on the first
error, so the checkpoint is read once for checking whatever the world size. Nothing is unpickled: tensors
come from safetensors files, everything else from JSON.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from ... import comm
from ...parallel.tensor.checkpoint import TPReader
from . import binding, layout, module_state, staged
from .agree import check_same_checkpoint
from .errors import CheckpointError
from .part import LoadContext
from .save import CLIENT_FILE, save_group, writer_of
from .state import check_rng_state, from_json, set_rng_state
from .tensor_file import TensorReader
from .turns import read_in_turns, relay_turn
from .universal import CheckpointReader, finish_params, load_params, names_by_id, owned_params


def verify_shared(ckpt: str, manifest: dict[str, Any], group: Any) -> None:
    """Every file's size on every rank; each file's sha256 on one rank; the same error on all ranks."""
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    names = sorted(manifest["files"])
    error = ""
    try:
        layout.verify_files(ckpt, manifest, names, hash_=False)
        layout.verify_files(ckpt, manifest, names[rank::world])
    except CheckpointError as exc:
        error = str(exc)
    errors = [e for e in comm.all_gather_object(error, group=group) if e]
    if errors:
        raise CheckpointError(errors[0])


def _partitioning(stage: int, world: int) -> str:
    """How the optimizer state is laid out: replicated (stage 0), or flat partitions over ``world`` ranks."""
    if stage == 0 or world == 1:
        return "unpartitioned (ZeRO stage 0, or a single data-parallel rank)"
    return f"partitioned by ZeRO stage {'3' if stage == 3 else '1/2'} over {world} data-parallel ranks"


def check_partitioning(engine: Any, meta: dict[str, Any], ckpt: str) -> None:
    """``checkpoint.load_universal: false`` (DeepSpeed's default): the optimizer state must go back into the
    partitioning it was saved from, as DeepSpeed requires of a non-universal checkpoint. ``true`` lets it
    reshard to any world size and stage (every zerospeed checkpoint is stored universally). A pipeline
    stage reads its layers by name at any degree (``PipelineStagePart``: ``partial_model``)."""
    if engine.config.checkpoint.load_universal or engine.optimizer is None or meta.get("optimizer") is None:
        return
    world = comm.get_world_size(engine.dp_group)
    tp = int(meta.get("tensor_parallel_size", 1))
    saved = _partitioning(int(meta["zero_stage"]), int(meta["world_size"]) // tp)
    if tp != int(engine.mp_world_size):
        saved += f" with tensor parallelism {tp}"
    here = _partitioning(engine.zero_optimization_stage(), world)
    if saved != here:
        raise CheckpointError(
            f"checkpoint {ckpt} holds optimizer state saved {saved}; this engine runs {here}. Loading it here "
            "reshards the optimizer state: set \"checkpoint\": {\"load_universal\": true} to allow that (zerospeed "
            "checkpoints reshard to any world size and stage), or load_checkpoint(..., load_optimizer_states=False)")


def open_checkpoint(load_dir: str, tag: Any, group: Any) -> tuple[str, dict, dict, dict] | None:
    """Collective over ``group``: find the checkpoint (every rank must find the same one), verify its shared
    files and return ``(path, manifest, meta, index)``; None (with a warning) when there is none."""
    try:
        ckpt, error = layout.resolve(os.fspath(load_dir), None if tag is None else str(tag)), ""
    except CheckpointError as exc:
        ckpt, error = None, str(exc)
    check_same_checkpoint(os.fspath(load_dir), ckpt, error, group)
    if ckpt is None:
        warnings.warn(f"no checkpoint to load: {os.path.join(load_dir, layout.LATEST)} does not exist "
                      "(pass tag= to pick one)", stacklevel=4)
        return None
    error = ""
    try:
        manifest = layout.read_manifest(ckpt)
    except CheckpointError as exc:
        error = str(exc)
    staged.agree(error, group, "load_checkpoint", "")
    verify_shared(ckpt, manifest, group)
    meta: Any = None
    index: Any = None
    try:
        meta = layout.read_json(os.path.join(ckpt, layout.META))
        index = layout.read_json(os.path.join(ckpt, layout.INDEX))
        if not isinstance(meta, dict) or meta.get("format") != layout.FORMAT:
            raise CheckpointError(f"{os.path.join(ckpt, layout.META)} is not zerospeed checkpoint metadata "
                                  "(field 'format')")
        binding.check_bound(ckpt, manifest, index, (layout.META, layout.INDEX), (layout.MODULE_FILE, CLIENT_FILE))
    except CheckpointError as exc:
        error = str(exc)
    staged.agree(error, group, "load_checkpoint", "")
    return ckpt, manifest, meta, index


def load_checkpoint(engine: Any, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
    """Collective and atomic (``staged``): stage and check everything, agree, then apply: the ZeRO groups'
    masters and the module's other tensors, then each of the engine's checkpoint parts (``part``) in order."""
    writer_of(engine).wait()
    group = save_group(engine)
    opened = open_checkpoint(load_dir, tag, group)
    if opened is None:
        return None, None
    ckpt, manifest, meta, index = opened
    what = f"load_checkpoint({ckpt!r})"
    ctx: LoadContext | None = None
    error = ""
    try:
        ctx = _stage(engine, ckpt, manifest, meta, index, group, load_module_strict, load_optimizer_states,
                     load_lr_scheduler_states, load_module_only)
    except _STAGE_ERRORS as exc:
        error = _message(exc)

    relay = engine.config.zero_optimization.pipeline_loading_checkpoint  # a node's ranks read one at a time
    if ctx is not None and not error:
        error = _read_staged(engine, ctx, keep=not relay)  # relay: only checked against the index here
    _agree_or_close(error, group, what, "; nothing was loaded, the engine is unchanged on every rank", ctx)
    assert ctx is not None
    from_fp32 = engine.config.zero_optimization.load_from_fp32_weights
    if relay:
        error = read_in_turns(lambda: relay_turn(ctx, _groups(engine), engine.optimizer, from_fp32), group)
        _agree_or_close(error, group, what, PARTLY, ctx)
    client: dict[str, Any] | None = None
    try:
        if relay:
            finish_params(ctx.sharded)
        else:
            load_params(_groups(engine), ctx.names, ctx.reader, from_fp32=from_fp32)
        module_state.load_rest(engine.module, ctx.grouped, meta["tensors"], os.path.join(ckpt, layout.MODULE_FILE),
                               ctx.reader)
        if not load_module_only:
            for part in engine.checkpoint_parts:
                part.load(meta.get(part.name) if part.name else None, ctx)
            if ctx.rng is not None:
                set_rng_state(ctx.rng)
        client = _client_state(ckpt, meta)
        error = ""
    except Exception as exc:  # noqa: BLE001 - agreed on and raised on every rank below
        error = f"{type(exc).__name__}: {exc}"
    finally:
        ctx.reader.close()
    staged.agree(error, group, what, PARTLY)
    return ckpt, client


PARTLY = "; the state may be partly loaded: build a new engine and load again"


def _agree_or_close(error: str, group: Any, what: str, after: str, ctx: LoadContext | None) -> None:
    try:
        staged.agree(error, group, what, after)
    except CheckpointError:
        if ctx is not None and ctx.reader is not None:
            ctx.reader.close()
        raise


def _groups(engine: Any) -> list[Any]:
    return list(engine.optimizer.groups) if engine.optimizer is not None else []


def _stage(engine: Any, ckpt: str, manifest: dict[str, Any], meta: dict[str, Any], index: dict[str, Any],
           group: Any, strict: bool, load_optimizer_states: bool, load_lr_scheduler_states: bool,
           module_only: bool) -> LoadContext:
    """Everything that can be checked before the engine changes (``staged``, step 1); the tensor reads follow
    (``_read_staged``: at once, or a node's ranks one after another under ``pipeline_loading_checkpoint``)."""
    rank = comm.get_rank(group)
    where = os.path.join(ckpt, layout.META)
    if not isinstance(meta.get("tensors"), dict):
        raise CheckpointError(f"{where}: field 'tensors' is not a mapping of name -> shape/dtype")
    names = names_by_id(engine.module)
    groups = _groups(engine)
    ctx = LoadContext(engine, ckpt, meta, names, {names[id(p)] for g in groups for p in g.params}, module_only,
                      load_optimizer_states and not module_only, load_lr_scheduler_states)
    if not module_only:
        rng_path = binding.rng_to_load(ckpt, manifest, layout.rng_file(rank), rank, meta.get("world_size"))
        if rng_path is not None:
            ctx.rng = layout.read_json(rng_path)
            check_rng_state(ctx.rng, rng_path)
    for part in engine.checkpoint_parts:
        part.check(meta.get(part.name) if part.name else None, ctx)
    if ctx.load_optimizer_states and not ctx.partial_model:
        check_partitioning(engine, meta, ckpt)
    module_state.check_names(engine.module, meta["tensors"], strict, ctx.partial_model)
    ctx.reader = staged.StagedReader(TPReader(CheckpointReader(ckpt, index), meta["tensors"], engine.module), ckpt)
    return ctx


_STAGE_ERRORS = (CheckpointError, ValueError, KeyError, TypeError, IndexError, OSError)


def _message(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def _read_staged(engine: Any, ctx: LoadContext, keep: bool = True) -> str:
    """Stage 1's reads (no communication): every tensor range this rank will own (``keep`` False: checked
    against the index only); an error message or ""."""
    try:
        staged.stage_tensors(ctx.reader, list(owned_params(_groups(engine), ctx.names)), ctx.layout, keep)
    except _STAGE_ERRORS as exc:
        return _message(exc)
    return ""


def _client_state(ckpt: str, meta: dict[str, Any]) -> dict[str, Any]:
    client_tensors: dict[str, torch.Tensor] = {}
    if os.path.isfile(os.path.join(ckpt, CLIENT_FILE)):
        with TensorReader(os.path.join(ckpt, CLIENT_FILE)) as cf:
            client_tensors = {k: cf.read(k) for k in cf.keys()}
    return from_json(meta.get("client_state") or {}, client_tensors)
