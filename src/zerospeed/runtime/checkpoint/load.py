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
from . import binding, layout, module_state, staged
from .agree import check_same_checkpoint
from .errors import CheckpointError
from .save import CLIENT_FILE, save_group, writer_of
from .state import check_rng_state, from_json, restore_param_group_options, set_rng_state
from .tensor_file import TensorReader
from .universal import CheckpointReader, load_optimizer_state, load_params, names_by_id, owned_params


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
    """Collective and atomic (``staged``): stage and check everything, agree, then apply."""
    writer_of(engine).wait()
    group = save_group(engine)
    opened = open_checkpoint(load_dir, tag, group)
    if opened is None:
        return None, None
    ckpt, manifest, meta, index = opened
    what = f"load_checkpoint({ckpt!r})"
    plan: dict[str, Any] = {}
    error = ""
    try:
        plan = _stage(engine, ckpt, manifest, meta, index, group, load_module_strict,
                      load_optimizer_states and not load_module_only, load_module_only)
    except (CheckpointError, ValueError, KeyError, TypeError, IndexError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError) else str(exc)
    try:
        staged.agree(error, group, what, "; nothing was loaded, the engine is unchanged on every rank")
    except CheckpointError:
        if "reader" in plan:
            plan["reader"].close()
        raise
    reader = plan["reader"]
    client: dict[str, Any] | None = None
    try:
        load_params(plan["groups"], plan["names"], reader,
                    from_fp32=engine.config.zero_optimization.load_from_fp32_weights)
        module_state.load_rest(engine.module, plan["grouped"], meta["tensors"], os.path.join(ckpt, layout.MODULE_FILE),
                               reader)
        if not load_module_only:
            _load_training_state(engine, meta, reader, plan["names"], load_optimizer_states, load_lr_scheduler_states)
            if plan["rng"] is not None:
                set_rng_state(plan["rng"])
        client = _client_state(ckpt, meta)
        error = ""
    except Exception as exc:  # noqa: BLE001 - agreed on and raised on every rank below
        error = f"{type(exc).__name__}: {exc}"
    finally:
        reader.close()
    staged.agree(error, group, what, "; the state may be partly loaded: build a new engine and load again")
    return ckpt, client


def _stage(engine: Any, ckpt: str, manifest: dict[str, Any], meta: dict[str, Any], index: dict[str, Any],
           group: Any, strict: bool, with_optimizer: bool, module_only: bool) -> dict[str, Any]:
    """Everything that can be checked or read before the engine changes (``staged``, step 1)."""
    from ...parallel.tensor.checkpoint import TPReader, base_name, remap_layout

    rank = comm.get_rank(group)
    where = os.path.join(ckpt, layout.META)
    if not isinstance(meta.get("tensors"), dict):
        raise CheckpointError(f"{where}: field 'tensors' is not a mapping of name -> shape/dtype")
    if with_optimizer:
        check_partitioning(engine, meta, ckpt)
    module_state.check_names(engine.module, meta["tensors"], strict)
    names = names_by_id(engine.module)
    groups = list(engine.optimizer.groups) if engine.optimizer is not None else []
    plan: dict[str, Any] = {"names": names, "groups": groups, "rng": None,
                            "grouped": {base_name(names[id(p)]) for g in groups for p in g.params}}
    plan["reader"] = reader = staged.StagedReader(TPReader(CheckpointReader(ckpt, index), meta["tensors"],
                                                           engine.module), ckpt)
    saved_opt = meta.get("optimizer")
    lay = None
    if not module_only:
        staged.check_counters(meta.get("engine"), where)
        if with_optimizer and engine.optimizer is not None and saved_opt is not None:
            lay = remap_layout(saved_opt["layout"], names)
            if len(saved_opt["param_groups"]) != len(engine.optimizer.optimizer.param_groups):
                raise CheckpointError(f"{where}: field 'optimizer.param_groups' has {len(saved_opt['param_groups'])} "
                                      f"groups, the engine's optimizer {len(engine.optimizer.optimizer.param_groups)}")
        rng_path = binding.rng_to_load(ckpt, manifest, layout.rng_file(rank), rank, meta.get("world_size"))
        if rng_path is not None:
            plan["rng"] = layout.read_json(rng_path)
            check_rng_state(plan["rng"], rng_path)
    staged.stage_tensors(reader, list(owned_params(groups, names)), lay)
    return plan


def _client_state(ckpt: str, meta: dict[str, Any]) -> dict[str, Any]:
    client_tensors: dict[str, torch.Tensor] = {}
    if os.path.isfile(os.path.join(ckpt, CLIENT_FILE)):
        with TensorReader(os.path.join(ckpt, CLIENT_FILE)) as cf:
            client_tensors = {k: cf.read(k) for k in cf.keys()}
    return from_json(meta.get("client_state") or {}, client_tensors)


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
