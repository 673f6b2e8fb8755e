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
from ...precision import NoScaler
from . import layout, module_state
from .agree import check_same_checkpoint
from .errors import CheckpointError
from .save import CLIENT_FILE, save_group, writer_of
from .state import from_json, restore_param_group_options, set_rng_state
from .tensor_file import TensorReader
from .universal import CheckpointReader, load_optimizer_state, load_params, names_by_id


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
    reshard to any world size and stage (every zerospeed checkpoint is stored universally)."""
    if engine.config.checkpoint.load_universal or engine.optimizer is None or meta.get("optimizer") is None:
        return
    world = comm.get_world_size(engine.dp_group)
    tp = int(meta.get("tensor_parallel_size", 1))
    saved = _partitioning(int(meta["zero_stage"]), int(meta["world_size"]) // tp)
    if tp != int(getattr(engine, "mp_world_size", 1)):
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
    manifest = layout.read_manifest(ckpt)
    verify_shared(ckpt, manifest, group)
    meta = layout.read_json(os.path.join(ckpt, layout.META))
    index = layout.read_json(os.path.join(ckpt, layout.INDEX))
    if meta.get("format") != layout.FORMAT:
        raise CheckpointError(f"{os.path.join(ckpt, layout.META)} is not zerospeed checkpoint metadata")
    return ckpt, manifest, meta, index


def load_checkpoint(engine: Any, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
    from ...parallel.tensor.checkpoint import TPReader, base_name

    writer_of(engine).wait()
    group = save_group(engine)
    rank = comm.get_rank(group)
    opened = open_checkpoint(load_dir, tag, group)
    if opened is None:
        return None, None
    ckpt, _, meta, index = opened
    if load_optimizer_states and not load_module_only:
        check_partitioning(engine, meta, ckpt)
    module_state.check_names(engine.module, meta["tensors"], load_module_strict)
    names = names_by_id(engine.module)
    groups = list(engine.optimizer.groups) if engine.optimizer is not None else []
    grouped = {base_name(names[id(p)]) for g in groups for p in g.params}
    reader = TPReader(CheckpointReader(ckpt, index), meta["tensors"], engine.module)
    try:
        load_params(groups, names, reader, from_fp32=engine.config.zero_optimization.load_from_fp32_weights)
        module_state.load_rest(engine.module, grouped, meta["tensors"], os.path.join(ckpt, layout.MODULE_FILE), reader)
        if not load_module_only:
            _load_training_state(engine, meta, reader, names, load_optimizer_states, load_lr_scheduler_states)
            rng_path = os.path.join(ckpt, layout.rng_file(rank))
            if os.path.isfile(rng_path):
                set_rng_state(layout.read_json(rng_path))
    finally:
        reader.close()
    client_tensors: dict[str, torch.Tensor] = {}
    if os.path.isfile(os.path.join(ckpt, CLIENT_FILE)):
        with TensorReader(os.path.join(ckpt, CLIENT_FILE)) as cf:
            client_tensors = {k: cf.read(k) for k in cf.keys()}
    return ckpt, from_json(meta.get("client_state") or {}, client_tensors)


def _load_training_state(engine: Any, meta: dict[str, Any], reader: Any, names: dict[int, str],
                         load_optimizer_states: bool, load_lr_scheduler_states: bool) -> None:
    saved_opt = meta.get("optimizer")
    if engine.optimizer is not None and saved_opt is not None and load_optimizer_states:
        opt = engine.optimizer.optimizer
        if saved_opt["type"] != type(opt).__name__:
            warnings.warn(f"checkpoint optimizer is {saved_opt['type']}, the engine's is {type(opt).__name__}; "
                          "loading its state by name anyway", stacklevel=4)
        restore_param_group_options(opt.param_groups, saved_opt["param_groups"])
        from ...parallel.tensor.checkpoint import remap_layout

        load_optimizer_state(list(engine.optimizer.groups), names, reader, remap_layout(saved_opt["layout"], names), opt)
        if not isinstance(engine.optimizer.loss_scaler, NoScaler):  # bf16/fp32 keep scale 1 whatever was saved
            engine.optimizer.loss_scaler.load_state_dict(saved_opt["loss_scaler"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    counters = meta["engine"]
    engine.global_steps = int(counters["global_steps"])
    engine.global_samples = int(counters["global_samples"])
    gas = int(counters.get("gradient_accumulation_steps", engine.gradient_accumulation_steps()))
    if gas == engine.gradient_accumulation_steps():
        engine.micro_steps = int(counters["micro_steps"])
    else:  # another world size or accumulation: count micro-steps in the new unit, from a step boundary
        if int(counters["micro_steps"]) % gas:
            warnings.warn("the checkpoint was saved in the middle of a gradient accumulation; its partial "
                          "gradients are not stored, the next step starts a fresh accumulation", stacklevel=4)
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    engine.skipped_steps = int(counters["skipped_steps"])
    if hasattr(engine.optimizer, "set_compression_steps"):  # the top-k warm-up counts optimizer steps taken
        engine.optimizer.set_compression_steps(engine.global_steps - engine.skipped_steps)
    loader = engine.training_dataloader
    if meta.get("data") is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(meta["data"])
    if meta.get("data_efficiency") is not None and engine.data_efficiency is not None:
        engine.data_efficiency.load_state_dict(meta["data_efficiency"])
